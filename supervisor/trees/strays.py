"""The tree keeper's reaping: members and orphans no tree pass saw (does I/O: /proc, waitid).

A child subreaper, and PID 1 of a container's pid namespace (the kernel hands
it every orphan of that namespace, `runc exec`'s included), gets orphans the
tree keeper may never see: a double fork's grandchild born and gone between
two passes, where no proc connector tells (cn_proc ignores listeners outside
the initial pid namespace, drivers/connector/cn_proc.c). Left alone, each
stays a zombie, holding a pid, until the daemon exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Mapping

from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
from supervisor.procfs.identity import ProcessId
from supervisor.procfs.stat import read_proc_stat

log = logging.getLogger("placement_supervisor.trees")


def exited_children(fs: HostFS, me: int, direct: Collection[int]) -> list[int]:
    """`me`'s children that are zombies, except `direct` (the runners' own children,
    each reaped by its runner, which needs its exit status). From
    /proc/<me>/task/*/children (proc(5)): an orphan goes to any live thread."""
    out: list[int] = []
    for tid in fs.listdir(f"proc/{me}/task"):
        text = fs.read_optional(f"proc/{me}/task/{tid}/children") or ""
        for pid in map(int, text.split()):
            if pid in direct:
                continue
            stat = read_proc_stat(fs, pid)
            if stat is not None and stat.state == "Z" and stat.ppid == me:
                out.append(pid)
    return out


def reap_strays(fs: HostFS, me: int, direct: Collection[int]) -> list[int]:
    """waitpid each of `exited_children`; returns those reaped."""
    reaped: list[int] = []
    for pid in exited_children(fs, me, direct):
        with contextlib.suppress(ChildProcessError, OSError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                reaped.append(pid)
                log.debug("orphan reaped %s", format_fields(pid=pid, action="reap"))
    return reaped


def any_zombie_child() -> bool:
    """Whether some child of this process (of any of its threads) has exited and
    waits to be reaped: one waitid(2) with WNOWAIT, which leaves it waitable.
    False means no reap can find anything: the /proc reads are skipped (a tree
    pass's reap ran 0.2 ms of /proc reads a second on an idle daemon)."""
    try:
        return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False  # no children at all


def reap_members(
    fs: HostFS,
    me: int,
    direct: Collection[int],
    candidates: Mapping[int, ProcessId],
    *,
    strays: bool,
) -> tuple[list[int], list[int]]:
    """waitpid each of `candidates` (pid -> who: members, and members gone)
    that is `me`'s zombie child and not in `direct`; with `strays`, every other
    zombie child too (`reap_strays`). Returns (reaped, gone: candidates that are
    no longer that process, to forget)."""
    reaped: list[int] = []
    gone: list[int] = []
    for pid, ident in candidates.items():
        stat = read_proc_stat(fs, pid)
        if not ident.matches(stat):
            gone.append(pid)
            continue
        assert stat is not None
        if stat.ppid != me or stat.state != "Z" or pid in direct:
            continue
        with contextlib.suppress(ChildProcessError, OSError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                reaped.append(pid)
    if strays:
        reaped.extend(reap_strays(fs, me, direct))
    return reaped, gone
