"""Who a tid is: its thread group and start time (I/O via HostFS; `parse_*` pure).

Tids and pids are reused host-wide: a thread of a supervised process that
exits may hand its tid to an unrelated process (issue 11). The scanner
(supervisor.watch.observe) re-checks a known tid's start time when its CPUs
change, and the applier (supervisor.watch.apply) checks a tid's Tgid and
start time before and after every write.
"""

from __future__ import annotations

from supervisor.hostfs import HostFS


def parse_stat_start_time(text: str) -> int | None:
    """Field 22 (starttime, clock ticks since boot) of a /proc/.../stat text (pure).

    The comm field (2) may hold spaces and parentheses: fields are counted
    after its last ")" (proc(5)). None when the text is torn or garbled.
    """
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


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
    return None if raw is None else parse_stat_start_time(raw.decode("utf-8", "replace"))


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
