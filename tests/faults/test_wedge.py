"""Issue 11 item 4: never wedge, never fail silently (real daemons, real children).

A config the kernel cannot exec is refused at load; a runner that finds
its fds exhausted at a restart reports it at once (an event and a log line),
backs off and retries while the rest runs on, and is running again once the
fds come back (issue 17: never held `failed` for it); a readiness timeout is a failed start
under the restart policy; `always` with a process that exits 0 at once ends
in `failed` through the crash-loop limit.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.children import reports, write_child
from tests.support.daemon_support import (
    REPO,
    DaemonProcess,
    child_config,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

FAST_RESTARTS = {
    "backoff_initial_s": 0.1,
    "backoff_max_s": 0.2,
    "crash_loop_limit": 3,
    "crash_loop_window_s": 60.0,
    "stable_after_s": 30.0,
}


def write_config(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(to_toml(doc))
    return path


def state_of(daemon: DaemonProcess, key: str) -> dict[str, Any] | None:
    doc = daemon.placement()
    if not doc:
        return None
    if key == "engine":
        entry: dict[str, Any] = doc["engine"]
        return entry
    return next(r for r in doc["ranks"] if str(r["rank"]) == key)


def metrics(daemon: DaemonProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/metrics", timeout=5) as resp:
        text: str = resp.read().decode()
        return text


# -- what execve cannot pass: exit 2 before anything starts ---------------------------


@pytest.mark.parametrize(
    ("workers", "needle"),
    [
        ('command = ["python", "-c", "x\\u0000y"]', "workers.command: item 2 contains a NUL byte"),
        ('command = ["true"]\nenv = { "A=B" = "1" }', "workers.env: bad variable name 'A=B'"),
        ('command = ["true"]\nenv = { X = "a\\u0000b" }', "workers.env.X: contains a NUL byte"),
    ],
)
def test_unexecutable_strings_are_exit_2_naming_the_key(
    tmp_path: Path, workers: str, needle: str
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        f'cgroup = "off"\n[placement.engine]\nenabled = false\n[workers]\n{workers}\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "run", "--config", str(config)],
        cwd=REPO,
        env=daemon_env(RUNTIME_DIRECTORY=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr[-2000:]


# -- restart semantics with real children ---------------------------------------------


def test_always_with_a_process_that_exits_0_at_once_ends_failed(tmp_path: Path) -> None:
    script, out = write_child(tmp_path)
    doc = child_config(script, out, restart={**FAST_RESTARTS, "policy": "always"})
    doc["cpu_ranks"] = 1
    doc["workers"]["command"] = ["python", "-c", "pass"]
    env = daemon_env(RUNTIME_DIRECTORY=str(tmp_path))
    with DaemonProcess(write_config(tmp_path, doc), tmp_path / "d.log", env=env) as daemon:
        rank = poll(lambda: (s := state_of(daemon, "0")) and s["state"] == "failed" and s, 30)
        assert rank["restarts"] == 2  # three quick clean exits: two restarts, then the limit
        failed = daemon.events("failed")
        assert failed and "crash loop" in failed[-1]["message"], failed
        assert daemon.proc.poll() is None


# An engine as real ones behave: SIGTERM is a clean shutdown, exit 0. It
# reports its start and never creates the ready file.
ENGINE_EXITING_0_ON_TERM = r"""
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with open(os.path.join(sys.argv[1], f"engine-{os.getpid()}.json"), "w") as f:
    json.dump({"pid": os.getpid()}, f)
while True:
    time.sleep(3600)
"""


def test_a_readiness_timeout_is_a_failed_start_never_ready(tmp_path: Path) -> None:
    script, out = write_child(tmp_path)
    engine = tmp_path / "engine.py"
    engine.write_text(ENGINE_EXITING_0_ON_TERM)
    doc = child_config(script, out, engine=True, restart=FAST_RESTARTS)
    doc["engine"]["command"] = ["python", str(engine), str(out)]
    doc["ready"]["timeout_s"] = 0.5
    doc["stop_timeout_s"] = 2
    env = daemon_env(RUNTIME_DIRECTORY=str(tmp_path))
    with DaemonProcess(write_config(tmp_path, doc), tmp_path / "d.log", env=env) as daemon:
        seen: set[str] = set()

        def engine_failed() -> bool:
            entry = state_of(daemon, "engine")
            if entry:
                seen.add(entry["state"])
            return bool(entry and entry["state"] == "failed")

        poll(engine_failed, timeout_s=60, what="the engine failed by the crash-loop limit")
        assert "running" not in seen and "stopped" not in seen, seen
        assert len(reports(out, "engine")) == 3  # started, not ready, restarted by policy
        assert reports(out, "0") == [] and reports(out, "1") == []  # workers never started
        failed = daemon.events("failed")
        assert failed and failed[-1]["message"].startswith("engine: not ready in time"), failed
        assert "(stopped, exited with status 0)" in failed[-1]["message"]
        assert not [e for e in daemon.events("ready") if e["rank"] == "engine"]


# -- a fault inside a runner ----------------------------------------------------------


def lowest_free_fd(pid: int, samples: int = 20) -> int:
    """The daemon's lowest free fd, the least of several looks: a thread of its
    own (the usage sampler, the API) may hold a file open for a moment, and a
    limit above the steady lowest would leave the restart a free fd."""
    lowest = []
    for _ in range(samples):
        used = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
        fd = 0
        while fd in used:
            fd += 1
        lowest.append(fd)
        time.sleep(0.005)
    return min(lowest)


def test_a_runner_out_of_fds_is_reported_at_once_retried_and_isolated(tmp_path: Path) -> None:
    script, out = write_child(tmp_path)
    doc = child_config(script, out, restart=FAST_RESTARTS)
    doc["drift"] = {"check_interval_s": 3600.0}  # no check opens files meanwhile
    env = daemon_env(RUNTIME_DIRECTORY=str(tmp_path))
    with DaemonProcess(write_config(tmp_path, doc), tmp_path / "d.log", env=env) as daemon:
        before = poll(daemon.running, timeout_s=60)
        victim = next(r for r in before["ranks"] if r["rank"] == 0)
        other = next(r for r in before["ranks"] if r["rank"] == 1)
        poll(lambda: len(reports(out, "0")) == 1 and len(reports(out, "1")) == 1, 10)
        soft, hard = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)
        limit = FAST_RESTARTS["crash_loop_limit"]
        # EMFILE for the next fd: the restart's report pipe cannot be made.
        resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (lowest_free_fd(daemon.pid), hard))
        try:
            os.kill(victim["pid"], signal.SIGKILL)
            # More failed starts than the crash-loop limit, each retried.
            poll(
                lambda: daemon.tail(100_000).count("out of file descriptors") > 2 * limit,
                30,
                what="the failed starts logged and retried past the crash-loop limit",
            )
        finally:
            resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (soft, hard))
        rank = poll(lambda: (s := state_of(daemon, "0")) and s["state"] == "running" and s, 30)
        assert rank["pid"] not in (None, victim["pid"])
        spawn_failed = daemon.events("spawn_failed")
        assert spawn_failed and "Too many open files" in spawn_failed[-1]["message"], spawn_failed
        assert not daemon.events("failed")
        assert 'placement_process_state{rank="0",state="running"} 1.0' in metrics(daemon)
        assert "supervision error" not in daemon.tail(100_000)
        # Isolated: the other rank runs on untouched and the daemon stays up.
        still = state_of(daemon, "1")
        assert still is not None and still["state"] == "running" and still["pid"] == other["pid"]
        assert daemon.proc.poll() is None
        assert daemon.stop() == 0
        assert "Traceback" not in daemon.tail(100_000)
