"""Process identity and /proc/<pid>/stat against real processes (procfs/identity.py, stat.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from supervisor.hostfs import HostFS
from supervisor.procfs.identity import ProcessId, is_leader_since, open_pidfd
from supervisor.procfs.stat import parse_proc_stat, read_proc_stat
from tests.support.poll import poll

FS = HostFS("/")


def test_parse_proc_stat_with_a_hostile_comm() -> None:
    line = "4242 (a) b (c) S 1 4242 4242 0 -1 4194560 10 0 0 0 7 3 0 0 20 0 1 0 98765 1 2"
    stat = parse_proc_stat(line)
    assert stat.pid == 4242
    assert stat.comm == "a) b (c"
    assert (stat.state, stat.ppid, stat.pgid) == ("S", 1, 4242)
    assert (stat.utime_ticks, stat.stime_ticks) == (7, 3)
    assert stat.start_time == 98765


def test_parse_proc_stat_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="stat"):
        parse_proc_stat("no parens here")


def test_own_stat_and_identity() -> None:
    me = read_proc_stat(FS, os.getpid())
    assert me is not None and me.pid == os.getpid() and me.ppid == os.getppid()
    assert ProcessId(os.getpid(), me.start_time).is_current(FS)
    assert not ProcessId(os.getpid(), me.start_time + 1).is_current(FS)
    assert ProcessId.read(FS, os.getpid()) == ProcessId(os.getpid(), me.start_time)


def _zombie() -> subprocess.Popen[bytes]:
    """A child that has exited and is not yet reaped (state Z)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    poll(
        lambda: (s := read_proc_stat(FS, child.pid)) is not None and s.state == "Z",
        10,
        0.01,
        what="the child a zombie",
    )
    return child


def test_a_zombie_is_current_but_not_running() -> None:
    child = _zombie()
    try:
        me = ProcessId.read(FS, child.pid)
        assert me is not None
        assert me.is_current(FS) and not me.is_running(FS)
    finally:
        child.wait()
    assert not me.is_current(FS)  # reaped: the pid names no process now


def test_a_pidfd_is_only_opened_for_the_same_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me = ProcessId.read(FS, child.pid)
        assert me is not None
        fd = me.open_pidfd(FS)
        assert fd is not None
        os.close(fd)
        # The same pid with another start time: what a reused pid looks like.
        assert ProcessId(child.pid, me.start_time + 1).open_pidfd(FS) is None
    finally:
        child.kill()
        child.wait()
    assert me.open_pidfd(FS) is None  # reaped


def test_a_signal_never_reaches_a_process_with_another_start_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me = ProcessId.read(FS, child.pid)
        assert me is not None
        assert not ProcessId(child.pid, me.start_time + 1).send_signal(FS, signal.SIGKILL)
        assert child.poll() is None  # still alive: the stale identity sent nothing
        assert me.send_signal(FS, signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert not me.send_signal(FS, signal.SIGTERM)  # reaped


def test_open_pidfd_raises_for_a_pid_that_names_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        open_pidfd(child.pid)


def test_the_leader_check_reads_the_main_thread() -> None:
    me = read_proc_stat(FS, os.getpid())
    assert me is not None
    assert is_leader_since(FS, os.getpid(), me.start_time)
    assert is_leader_since(FS, os.getpid(), None)
    assert not is_leader_since(FS, os.getpid(), me.start_time + 1)
