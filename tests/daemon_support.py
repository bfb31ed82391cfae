"""Shared pieces of the daemon tests: a reporting child program and config builders.

The child's first action is to write where it runs (affinity, memory policy,
environment) as JSON into a directory, one file per start, so a test can see
each start's placement from the inside.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHILD = r"""
import json, os, signal, sys, time

out, key, mode = sys.argv[1], sys.argv[2], sys.argv[3]
# First action: report what the kernel says about us.
status = open("/proc/self/status").read()
fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
maps = open("/proc/self/numa_maps").read().split("\n")
doc = {
    "pid": os.getpid(),
    "key": key,
    "cpus": sorted(os.sched_getaffinity(0)),
    "cpus_allowed_list": fields.get("Cpus_allowed_list", "").strip(),
    "mems_allowed_list": fields.get("Mems_allowed_list", "").strip(),
    "policy": maps[0].split()[1] if maps and maps[0] else "?",
    "env": {k: v for k, v in os.environ.items() if k in (
        "PLACEMENT_SUPERVISOR_SLOT", "CUDA_VISIBLE_DEVICES", "NOTIFY_SOCKET",
        "WATCHDOG_USEC", "DEMO_DEFAULT", "DEMO_FORCED")},
}
tmp = os.path.join(out, f"{key}-{os.getpid()}.tmp")
with open(tmp, "w") as f:
    json.dump(doc, f)
os.rename(tmp, tmp[:-4] + ".json")
if mode == "crash" or (mode.startswith("crash-rank-") and key == mode[len("crash-rank-"):]):
    sys.exit(3)
if mode == "ready-file":
    time.sleep(0.3)
    open(os.path.join(out, "engine.ready"), "w").close()
while True:
    time.sleep(3600)
"""


def write_child(tmp_path: Path) -> tuple[Path, Path]:
    """The child program and its report directory."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / "reports"
    out.mkdir()
    return script, out


def reports(out: Path, key: str) -> list[dict[str, Any]]:
    """Every start's report for `key`, oldest first."""
    docs = []
    for path in out.glob(f"{key}-*.json"):
        docs.append(json.loads(path.read_text()))
    return sorted(docs, key=lambda d: os.stat(out / f"{key}-{d['pid']}.json").st_mtime_ns)


def report_of(out: Path, key: str, pid: int) -> dict[str, Any] | None:
    path = out / f"{key}-{pid}.json"
    return json.loads(path.read_text()) if path.exists() else None


def poll(predicate: Callable[[], Any], timeout_s: float = 20.0, interval_s: float = 0.05) -> Any:
    """Poll until `predicate()` is truthy; returns it, or raises after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout_s}s: {predicate}")
        time.sleep(interval_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(type(value))


def to_toml(doc: dict[str, Any]) -> str:
    """A tiny TOML writer for test configs: scalars first, then one level of tables."""
    lines = [f"{k} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for name, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{name}]")
            lines.extend(f"{k} = {toml_value(v)}" for k, v in table.items())
    return "\n".join(lines) + "\n"


def child_config(
    script: Path,
    out: Path,
    *,
    mode: str = "sleep",
    engine: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """A config document whose workers (and engine) are the reporting child."""
    doc: dict[str, Any] = {
        "cpu_ranks": 2,
        "cgroup": "off",
        "stop_timeout_s": 3,
        "workers": {"command": ["python", str(script), str(out), "{rank}", mode]},
        "restart": {
            "backoff_initial_s": 0.2,
            "backoff_max_s": 1.0,
            "crash_loop_limit": 3,
            "crash_loop_window_s": 60.0,
            "stable_after_s": 30.0,
        },
        "placement": {"rank_roles": {}},
    }
    if engine:
        doc["engine"] = {"command": ["python", str(script), str(out), "engine", "ready-file"]}
        doc["ready"] = {"file": str(out / "engine.ready"), "timeout_s": 20}
    else:
        doc["placement"]["engine"] = {"enabled": False}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return doc
