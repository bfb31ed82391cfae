"""Only a live process the rank rule names, and still the engine's, becomes a rank
(a real daemon, a real launcher, real forks)."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

from supervisor.hostfs import HostFS
from supervisor.procfs.stat import read_proc_stat
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

# The engine starts a worker with LOCAL_RANK=0 and starts it again when it
# dies. Each worker forks a child at once, before anyone could adopt the
# worker: the child inherits LOCAL_RANK=0 and lives on when its worker dies.
LAUNCHER = r"""
import os, subprocess, sys, time
marker, ready, worker = sys.argv[1:4]
env = {**os.environ, "LOCAL_RANK": "0"}
# sh forks the child first (it inherits LOCAL_RANK=0; setsid: its own session,
# so it outlives the worker), then execs the worker: the child is there
# before anyone could adopt the worker.
script = (
    'setsid "$0" -c "import time; time.sleep(3600)" "$1" orphan-kid & '
    'exec "$0" -c "import time; time.sleep(3600)" "$1" worker'
)
def start():
    return subprocess.Popen(["/bin/sh", "-c", script, sys.executable, marker], env=env)
proc = start()
open(ready, "w").close()
while True:
    if proc.poll() is not None:
        proc = start()
    time.sleep(0.05)
"""


def _config(tmp_path: Path, marker: str) -> Path:
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    ready = tmp_path / "engine.ready"
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "auto",
        "stop_timeout_s": 2,
        "engine": {"command": ["python", str(launcher), marker, str(ready), "-"]},
        "ready": {"file": str(ready), "timeout_s": 30},
        "workers": {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
    }
    path = tmp_path / "stale.toml"
    path.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 0.2\n")
    return path


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _rank0(d: DaemonProcess, exclude: frozenset[int] = frozenset()) -> int | None:
    doc = d.placement()
    if doc is None:
        return None
    rank = doc["ranks"][0]
    if rank["state"] != "running" or not rank.get("adopted") or rank["pid"] in exclude:
        return None
    pid: int = rank["pid"]
    return pid


def test_a_workers_child_never_becomes_the_rank(tmp_path: Path) -> None:
    marker = f"stale-{uuid.uuid4().hex}"
    env = daemon_env(**{INSTANCE_ENV: f"stale-{os.getpid()}"})
    with DaemonProcess(_config(tmp_path, marker), tmp_path / "d.log", env=env) as d:
        first = poll(lambda: _rank0(d), timeout_s=60, what="the first worker adopted")
        assert _cmdline(first).endswith(" worker ")
        os.kill(first, signal.SIGKILL)
        second = poll(
            lambda: _rank0(d, exclude=frozenset({first})),
            timeout_s=30,
            what="the engine's next worker adopted",
        )
        # The rank is the engine's new worker (its parent is the launcher),
        # not the first worker's orphaned child.
        stat = read_proc_stat(HostFS("/"), second)
        engine = (d.placement() or {})["engine"]["pid"]
        assert stat is not None and stat.ppid == engine, _cmdline(second)
        assert _cmdline(second).endswith(" worker ")
        code = d.stop(timeout_s=30)
    assert code == 0, d.tail()
    leftovers = subprocess.run(
        ["pgrep", "-f", marker], capture_output=True, text=True, check=False
    ).stdout.split()
    assert leftovers == [], leftovers  # the orphaned children ended with the tree
