"""Nothing on the host but the config stops a start: a process of anyone's with a
1.2 MB command line (legal: ARG_MAX is 2 MiB, one word at most 128 KiB), or one
whose /proc files cannot be read, is skipped by every whole-host /proc walk.

Real processes and a real daemon with real cgroups (cgroup = "auto").
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.bind.irq import detect_irqbalance
from supervisor.hostfs import HostFS
from supervisor.trees.guardian import GUARDIAN_TAG, live_guardian
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

BIG_WORDS = ["x" * 100_000 for _ in range(12)]  # 1.2 MB


@pytest.fixture
def big_process() -> Iterator[int]:
    """A process with a 1.2 MB command line, for as long as the test runs."""
    code = "import sys, time; print('up', flush=True); time.sleep(120)"
    child = subprocess.Popen([sys.executable, "-c", code, *BIG_WORDS], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        assert len(Path(f"/proc/{child.pid}/cmdline").read_bytes()) > 1_200_000
        yield child.pid
    finally:
        child.kill()
        child.wait()


def test_the_guardian_search_passes_a_huge_command_line(big_process: int) -> None:
    assert live_guardian(HostFS("/"), f"/nonexistent/{uuid.uuid4().hex}") is None


def _garbled_proc(tmp_path: Path) -> HostFS:
    """A /proc whose processes 7 and 8 have a cmdline and comm that cannot be read
    (directories: EISDIR), and whose process 9 is a live guardian of "inst"."""
    for pid in (7, 8):
        (tmp_path / f"proc/{pid}/cmdline").mkdir(parents=True)
        (tmp_path / f"proc/{pid}/comm").mkdir(parents=True)
    (tmp_path / "proc/9").mkdir(parents=True)
    (tmp_path / "proc/9/cmdline").write_bytes(f"python\0-m\0{GUARDIAN_TAG}\0inst\0".encode())
    (tmp_path / "proc/9/stat").write_text(
        "9 (python) S 10 9 9 0 -1 0 0 0 0 0 1 1 0 0 20 0 1 0 5 0 0"
    )
    (tmp_path / "proc/10").mkdir(parents=True)
    (tmp_path / "proc/10/cmdline").write_bytes(b"python\0-m\0supervisor\0run\0")
    return HostFS(str(tmp_path))


def test_a_walk_skips_unreadable_processes_in_one_counted_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fs = _garbled_proc(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert live_guardian(fs, "inst") == (9, 10)  # found past the unreadable ones
        assert detect_irqbalance(fs) is None
    lines = [r.getMessage() for r in caplog.records if "proc walk skipped" in r.getMessage()]
    assert len(lines) == 2, lines  # one per walk, not one per process
    assert 'walk="guardian search"' in lines[0] and "processes=2" in lines[0], lines
    assert 'walk="irqbalance search"' in lines[1] and "processes=2" in lines[1], lines


def _instance_dirs(suffix: str) -> list[str]:
    name = f"placement-supervisor-{suffix}"
    return [
        os.path.join(top, d)
        for top, dirs, _ in os.walk("/sys/fs/cgroup")
        for d in dirs
        if d == name
    ]


def _config(tmp_path: Path) -> Path:
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "stop_timeout_s": 2,
        "workers": {"command": ["python", "-c", "import time; time.sleep(3600)", "{rank}"]},
        "placement": {"rank_roles": {}, "on_shortage": "share", "engine": {"enabled": False}},
    }
    config = tmp_path / "hostile.toml"
    config.write_text(to_toml(doc))
    return config


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root here")
def test_a_daemon_starts_beside_a_huge_command_line(tmp_path: Path, big_process: int) -> None:
    suffix = f"hostile-{uuid.uuid4().hex[:8]}"
    env = daemon_env(**{INSTANCE_ENV: suffix})
    with DaemonProcess(_config(tmp_path), tmp_path / "d.log", env=env) as d:
        poll(d.running, timeout_s=60, what="the daemon running beside a 1.2 MB command line")
        assert _instance_dirs(suffix), "cgroup = auto made no instance dir: nothing tested"
        code = d.stop(timeout_s=30)
    log = d.log.read_text(errors="replace")
    assert code == 0, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert _instance_dirs(suffix) == [], log[-4000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root here")
def test_a_failed_start_leaves_no_cgroup_dir(tmp_path: Path) -> None:
    # The API's port is taken: the start fails (exit 2) after the cgroups were made.
    suffix = f"hostile-{uuid.uuid4().hex[:8]}"
    env = daemon_env(**{INSTANCE_ENV: suffix})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = DaemonProcess(_config(tmp_path), tmp_path / "d.log", env=env, port=port)
        code = d.proc.wait(timeout=60)
        d.stop()
    log = d.log.read_text(errors="replace")
    assert code == 2, log[-4000:]
    assert "cgroups version=" in log, log[-4000:]  # they were made, so their removal is tested
    assert _instance_dirs(suffix) == [], log[-4000:]
