"""Who a tid is: its thread group and start time (I/O via HostFS; `parse_*` pure).

Tids and pids are reused host-wide: a thread of a supervised process that
exits may hand its tid to an unrelated process (issue 11). The scanner
(supervisor.watch.observe) re-checks a known tid's start time when its CPUs
change, and the applier (supervisor.watch.apply) checks a tid's Tgid and
start time before and after every write.
"""

from __future__ import annotations

from supervisor.hostfs import HostFS
from supervisor.run.procs import parse_proc_stat


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

    Tids are reused host-wide: a thread that exited may hand its tid to an
    unrelated process (issue 11). Checked by the thread's Tgid
    (/proc/<pid>/task/<tid>/status) and its start time (stat field 22);
    `start_time` None checks the Tgid only.
    """
    status = fs.read_optional(f"proc/{pid}/task/{tid}/status")
    if status is None or parse_status_tgid(status) != pid:
        return False
    if start_time is None:
        return True
    return read_thread_start(fs, pid, tid) == start_time
