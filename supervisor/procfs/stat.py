"""/proc/<pid>/stat: the fields the supervisor uses, one process or the whole table
(`parse_*` and `children_map` pure, `read_*` and `scan_*` via HostFS)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from supervisor.errors import KernelError
from supervisor.hostfs import HostFS

# 52 fields of at most 20 digits and a comm of 64 bytes at most (TASK_COMM_LEN 16,
# escaped): one read of this size gets the whole line.
STAT_MAX_BYTES = 4096


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of /proc/<pid>/stat the supervisor uses (proc(5))."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    utime_ticks: int  # field 14
    stime_ticks: int  # field 15
    start_time: int  # field 22: clock ticks after boot


def parse_proc_stat(text: str) -> ProcStat:
    """Parse one /proc/<pid>/stat line (pure); ValueError when garbled.

    comm (field 2) is in parentheses and may itself hold spaces and ")", so
    the fields after it are split from the *last* ")" (proc(5)).
    """
    open_at = text.find("(")
    close_at = text.rfind(")")
    if open_at < 0 or close_at < open_at:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    pid = int(text[:open_at])
    comm = text[open_at + 1 : close_at]
    rest = text[close_at + 2 :].split()
    # rest[0] is field 3 (state); field N is rest[N - 3].
    if len(rest) < 20:
        raise ValueError(f"/proc/{pid}/stat has {len(rest) + 2} fields, expected >= 22")
    return ProcStat(
        pid=pid,
        comm=comm,
        state=rest[0],
        ppid=int(rest[1]),
        pgid=int(rest[2]),
        utime_ticks=int(rest[11]),
        stime_ticks=int(rest[12]),
        start_time=int(rest[19]),
    )


def read_proc_stat(fs: HostFS, pid: int, *, main_thread: bool = False) -> ProcStat | None:
    """/proc/<pid>/stat through HostFS; None when the process is gone (or its
    stat cannot be read: stat is world-readable, so that is a garbled tree).

    One os.open and os.read (HostFS.read_live): this runs for every fork in a
    tree, and a fork storm's processes are mostly gone by the time it does.

    `main_thread`: read /proc/<pid>/task/<pid>/stat, the main thread's, on the
    live host. Its pid, comm, state, parent, group and start time are the
    process's; its times are that thread's alone. The process's file adds up
    every thread's times (fs/proc/array.c do_task_stat, whole=1): for a worker
    of 100 threads it took twice as long, and the tables below need no times."""
    rel = f"proc/{pid}/task/{pid}/stat" if main_thread and fs.is_live else f"proc/{pid}/stat"
    try:
        raw = fs.read_live(rel, STAT_MAX_BYTES, f"pid {pid}")
    except KernelError:
        return None
    if raw is None:
        return None
    try:
        return parse_proc_stat(raw.decode("utf-8", "replace"))
    except ValueError:
        return None


def scan_procs(fs: HostFS) -> dict[int, ProcStat]:
    """Every process's /proc/<pid>/stat (threads are not listed in /proc itself);
    the times are each main thread's (`read_proc_stat`'s `main_thread`)."""
    return scan_pids(fs, (int(name) for name in fs.listdir("proc") if name.isdigit()))


def scan_pids(fs: HostFS, pids: Iterable[int]) -> dict[int, ProcStat]:
    """/proc/<pid>/stat of `pids` alone (those still there): a tree pass scoped
    to the trees' cgroups reads a few dozen files, not every process of the host."""
    table: dict[int, ProcStat] = {}
    for pid in pids:
        stat = read_proc_stat(fs, pid, main_thread=True)
        if stat is not None:
            table[stat.pid] = stat
    return table


def children_map(table: Mapping[int, ProcStat]) -> dict[int, list[int]]:
    """ppid -> child pids (pure)."""
    out: dict[int, list[int]] = {}
    for stat in table.values():
        out.setdefault(stat.ppid, []).append(stat.pid)
    return out
