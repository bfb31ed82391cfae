"""Who a pid or tid is: a `ProcessId` (pid + start time) and the thread checks (I/O via HostFS).

Pids and tids are reused host-wide once their process is reaped: the start
time (stat field 22, clock ticks after boot; proc(5)) tells the new process
from the old one. Every "is this still the same process?" goes through here,
and so does every pidfd the daemon opens (pidfd_open(2), Linux 5.3).
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass

from supervisor.hostfs import HostFS
from supervisor.procfs.stat import ProcStat, parse_proc_stat, read_proc_stat

_NO_PIDFD = (errno.ENOSYS, errno.EPERM)  # no pidfds on this kernel, or seccomp forbids them


def open_pidfd(pid: int) -> int | None:
    """A pidfd for `pid`; None where the kernel has none (before 5.3, or forbidden).

    Other errors (ESRCH: already reaped) are raised: the caller decides."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd: int = opener(pid)
    except OSError as err:
        if err.errno in _NO_PIDFD:
            return None
        raise
    return fd


@dataclass(frozen=True, slots=True, order=True)
class ProcessId:
    """A process for its whole life: its pid and its start time.

    Hashable and ordered (pid, then start time): sets and maps of processes are
    keyed by it, and a sorted listing reads in pid order."""

    pid: int
    start_time: int

    @classmethod
    def of(cls, stat: ProcStat) -> ProcessId:
        return cls(stat.pid, stat.start_time)

    @classmethod
    def read(cls, fs: HostFS, pid: int) -> ProcessId | None:
        """The process that holds `pid` now; None when there is none."""
        stat = read_proc_stat(fs, pid)
        return None if stat is None else cls(pid, stat.start_time)

    def matches(self, stat: ProcStat | None) -> bool:
        """True when `stat` (read now) is this process's."""
        return stat is not None and stat.pid == self.pid and stat.start_time == self.start_time

    def is_current(self, fs: HostFS) -> bool:
        """True while `pid` still names this process (a zombie included)."""
        return self.matches(read_proc_stat(fs, self.pid))

    def leads(self, fs: HostFS) -> bool:
        """True while `pid`'s main thread is this process's (`is_leader_since`)."""
        return is_leader_since(fs, self.pid, self.start_time)

    def is_running(self, fs: HostFS) -> bool:
        """True while `pid` names this process and it has not exited (no zombie)."""
        stat = read_proc_stat(fs, self.pid)
        return self.matches(stat) and stat is not None and stat.state not in ("Z", "X")

    def open_pidfd(self, fs: HostFS) -> int | None:
        """A pidfd that names this process, or None (gone, reused, or no pidfds).

        Opened first, checked after: once the pidfd is held the pid cannot be
        reused, so a start time that still matches means the pidfd is ours."""
        try:
            fd = open_pidfd(self.pid)
        except OSError:
            return None
        if fd is None:
            return None
        if not self.is_current(fs):
            os.close(fd)
            return None
        return fd

    def send_signal(self, fs: HostFS, sig: int) -> bool:
        """Signal this process, never a process that reused its pid; False when gone.

        Through a pidfd where there is one (checked, then signalled with no
        window for reuse); without pidfds, a checked kill(2)."""
        try:
            fd = open_pidfd(self.pid)
        except OSError:
            return False
        try:
            if not self.is_current(fs):
                return False
            if fd is None:
                os.kill(self.pid, sig)
            else:
                signal.pidfd_send_signal(fd, sig)
            return True
        except OSError:
            return False
        finally:
            if fd is not None:
                os.close(fd)


# -- threads ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class ThreadId:
    """A thread of a known process for its whole life: its tid and its start time.

    Not a ProcessId: a tid is checked under its own thread group's task
    directory (/proc/<pid>/task/<tid>), which answers only for that group's
    threads, never through /proc/<tid> (any process's thread) as ProcessId's
    reads, signals and pidfds would do."""

    tid: int
    start_time: int

    def is_thread_of(self, fs: HostFS, pid: int) -> bool:
        """True while `tid` is still this thread, in process `pid`."""
        return is_thread_of(fs, pid, self.tid, self.start_time)


def parse_status_tgid(text: str) -> int | None:
    """The Tgid of a /proc/.../status text (pure); None when absent."""
    for line in text.splitlines():
        if line.startswith("Tgid:"):
            value = line[5:].strip()
            return int(value) if value.isdigit() else None
    return None


def read_thread_start(fs: HostFS, pid: int, tid: int) -> int | None:
    """The start time of thread `tid` of process `pid`; None when `tid` is no
    thread of `pid` (any more): /proc/<pid>/task/<tid> exists only for the
    threads of `pid`'s thread group (fs/proc/base.c proc_task_lookup)."""
    raw = fs.read_live(f"proc/{pid}/task/{tid}/stat", 1024, f"tid {tid}")
    if raw is None:
        return None
    try:
        return parse_proc_stat(raw.decode("utf-8", "replace")).start_time
    except ValueError:  # torn or garbled: no identity to trust
        return None


def is_thread_of(fs: HostFS, pid: int, tid: int, start_time: int | None) -> bool:
    """True when `tid` is still the thread of `pid` that started at `start_time`.

    Checked by the thread's Tgid (/proc/<pid>/task/<tid>/status) and its start
    time (stat field 22); `start_time` None checks the Tgid only.
    """
    status = fs.read_optional(f"proc/{pid}/task/{tid}/status")
    if status is None or parse_status_tgid(status) != pid:
        return False
    return start_time is None or read_thread_start(fs, pid, tid) == start_time


def is_leader_since(fs: HostFS, pid: int, start_time: int | None) -> bool:
    """True when `pid`'s main thread is still the one that started at `start_time`
    (None: nothing to check). Reads the task entry, so a thread of another
    process can never answer for it."""
    return start_time is None or read_thread_start(fs, pid, pid) == start_time
