"""Processes with megabytes of command line or environment (legal under ARG_MAX):
read by their heads and named variables, never whole, and never a failed pass.

Each case runs real processes: a 1.2 MB command line is 12 arguments of 100 KB
and a 1.2 MB environment 12 variables of 100 KB (one string may not exceed
MAX_ARG_STRLEN, 128 KiB; execve(2)).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from supervisor.hostfs import HostFS
from supervisor.procfs.files import CMDLINE_HEAD_BYTES, read_cmdline, read_environ
from supervisor.serve.metrics import build_registry
from supervisor.state import StateStore
from supervisor.trees.tree import ReadFailures
from tests.support.api_fixture import realistic_snapshot
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

FS = HostFS("/")
BIG_WORDS = ["x" * 100_000 for _ in range(12)]  # 1.2 MB
BIG_ENV = {f"BIG{i}": "y" * 100_000 for i in range(12)}  # 1.2 MB


def _sleeper(argv_tail: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    code = "import sys, time; print('up', flush=True); time.sleep(60)"
    child = subprocess.Popen(
        [sys.executable, "-c", code, *argv_tail], env=env, stdout=subprocess.PIPE
    )
    assert child.stdout is not None and child.stdout.readline() == b"up\n"
    return child


def test_a_huge_command_line_reads_as_its_head() -> None:
    child = _sleeper(["title-first", *BIG_WORDS], dict(os.environ))
    try:
        with open(f"/proc/{child.pid}/cmdline", "rb") as f:
            assert len(f.read()) > 1_000_000  # the whole thing is there to read
        head = read_cmdline(FS, child.pid)
        assert head is not None
        assert "title-first" in head
        assert len(head) <= CMDLINE_HEAD_BYTES
    finally:
        child.kill()
        child.wait()
    assert read_cmdline(FS, child.pid) is None  # gone


def test_a_variable_behind_a_huge_environment_is_found() -> None:
    # dict order is the order execve gets: LOCAL_RANK after 1.2 MB of others.
    env = {**os.environ, **BIG_ENV, "LOCAL_RANK": "3", "TAIL": "t"}
    child = _sleeper([], env)
    try:
        got = read_environ(FS, child.pid, ["LOCAL_RANK", "NOT_SET"])
        assert got == {"LOCAL_RANK": "3"}
        assert read_environ(FS, child.pid, ["TAIL", "BIG0"]) == {
            "TAIL": "t",
            "BIG0": BIG_ENV["BIG0"],
        }
        assert read_environ(FS, child.pid, []) == {}
    finally:
        child.kill()
        child.wait()
    assert read_environ(FS, child.pid, ["LOCAL_RANK"]) is None


def test_environ_split_across_chunks_on_a_fixture_tree(tmp_path: Path) -> None:
    proc = tmp_path / "proc/7"
    proc.mkdir(parents=True)
    # The wanted variable straddles the 64 KiB chunk boundary.
    pad = b"PAD=" + b"p" * ((1 << 16) - 10) + b"\0"
    (proc / "environ").write_bytes(pad + b"LOCAL_RANK=5\0Z=1")
    got = read_environ(HostFS(str(tmp_path)), 7, ["LOCAL_RANK", "Z"])
    assert got == {"LOCAL_RANK": "5", "Z": "1"}


# -- a real daemon ---------------------------------------------------------------------------

LAUNCHER = r"""
import os, subprocess, sys, time
marker, ready = sys.argv[1:3]
big_env = {f"BIG{i}": "y" * 100_000 for i in range(12)}
sleep = [sys.executable, "-c", "import time; time.sleep(3600)", marker]
# A worker whose rank sits behind 1.2 MB of environment.
env = {**os.environ, **big_env, "LOCAL_RANK": "0"}
subprocess.Popen([*sleep, "worker"], env=env)
# A helper of the engine with a 1.2 MB command line.
subprocess.Popen([*sleep, "helper", *["x" * 100_000 for _ in range(12)]])
open(ready, "w").close()
time.sleep(3600)
"""


def test_a_daemon_adopts_and_lists_through_big_files(tmp_path: Path) -> None:
    marker = f"big-{uuid.uuid4().hex}"
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    ready = tmp_path / "engine.ready"
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "stop_timeout_s": 2,
        "engine": {"command": ["python", str(launcher), marker, str(ready)]},
        "ready": {"file": str(ready), "timeout_s": 30},
        "workers": {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
    }
    config = tmp_path / "big.toml"
    config.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 0.2\n")
    env = daemon_env(**{INSTANCE_ENV: f"big-{os.getpid()}"})
    with DaemonProcess(config, tmp_path / "d.log", env=env) as d:

        def adopted() -> dict[str, Any] | None:
            placement = d.placement()
            if placement is None:
                return None
            rank = placement["ranks"][0]
            return placement if rank["state"] == "running" and rank.get("adopted") else None

        placement = poll(adopted, timeout_s=60, what="the big-environment worker adopted")

        def helper_listed() -> bool:
            children = (d.placement() or placement)["engine"]["children"]
            return any("helper" in c["cmdline"] for c in children)

        poll(helper_listed, timeout_s=30, what="the big-command-line helper listed")
        code = d.stop(timeout_s=30)
    log = d.log.read_text(errors="replace")
    assert code == 0, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert "tree pass failed" not in log, log[-4000:]


def test_read_failures_are_counted_each_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = StateStore(realistic_snapshot())
    failures = ReadFailures(store, logging.getLogger("test.read_failures"))
    with caplog.at_level(logging.WARNING, logger="test.read_failures"):
        for pid in (11, 12, 13):
            failures.note(pid, "pid 11: permission denied")
    assert store.snapshot.counters.process_read_failures == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pid=11" in lines[0] and 'action="skip this pass"' in lines[0]
    registry = build_registry(store)
    assert registry.get_sample_value("placement_process_read_failures_total") == 3
