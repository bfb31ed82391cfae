"""Orphans no tree pass saw, reaped (does I/O: /proc reads, waitpid).

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
from collections.abc import Collection

from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
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
