"""Whole-host /proc walks: one file of every process, the unreadable ones skipped and
counted (I/O via HostFS).

Any local user can run a process whose files this daemon cannot read (a command
line over the read cap, a pid namespace or `hidepid` that hides it, a garbled
entry): a walk over every process of the host must never fail on one of them,
since nothing on the host but the config may stop a start. Each walk logs the
processes it skipped in one line, with their count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

from supervisor.errors import SupervisorError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields

log = logging.getLogger("placement_supervisor.procfs")

T = TypeVar("T")


def host_pids(fs: HostFS) -> list[int]:
    """Every process id /proc lists (threads are not listed in /proc itself)."""
    return [int(name) for name in fs.listdir("proc") if name.isdigit()]


def walk_host(fs: HostFS, walk: str, read: Callable[[int], T | None]) -> Iterator[tuple[int, T]]:
    """(pid, `read(pid)`) for every process where `read` gave something; a process
    gone meanwhile (None) is passed over, one that cannot be read (any OSError or
    SupervisorError: EACCES, a file over its cap, garbled text) is skipped and
    counted, and the walk logs those in one line when it ends: `walk` names it.
    """
    skipped: list[str] = []
    try:
        for pid in host_pids(fs):
            try:
                value = read(pid)
            except (OSError, SupervisorError, ValueError) as err:
                skipped.append(str(err) if str(pid) in str(err) else f"pid {pid}: {err}")
                continue
            if value is not None:
                yield pid, value
    finally:  # also when the caller stopped early, having found what it looked for
        if skipped:
            log.warning(
                "proc walk skipped %s",
                format_fields(
                    walk=walk, processes=len(skipped), first=skipped[0], action="skip them"
                ),
            )
