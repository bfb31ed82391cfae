"""The daemon's file descriptor limit: raised once at start, split between the API and the rest.

`raise_fd_limit` does I/O (getrlimit/setrlimit(2) on RLIMIT_NOFILE);
`plan_fd_budget` is pure: how many API connections fit beside the reserve
that spawning (report pipes, pidfds), the proc connector, /proc reads and
the self-usage sampler need.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

from supervisor.logs import format_fields

log = logging.getLogger("placement_supervisor.daemon")

# Spawning one process takes a report pipe (2), a pidfd, /dev/null, and the
# fork's pipes inside subprocess (2 more) for a moment; each tracked process
# of a tree holds a pidfd; /proc reads, cgroup writes, the proc connector and
# the instance lock take a few more. 128 covers a 16-rank host with room; a
# quarter of a larger limit keeps the same share as the hosts grow.
MIN_FD_RESERVE = 128
FD_RESERVE_SHARE = 4  # soft // 4 when that is more


@dataclass(frozen=True, slots=True)
class FdLimit:
    """RLIMIT_NOFILE as found and as left (soft == hard once raised)."""

    soft_before: int
    soft: int
    hard: int
    error: str | None = None  # why the raise did not happen, when it did not


@dataclass(frozen=True, slots=True)
class FdBudget:
    """API connections at most, and the descriptors no connection may take."""

    max_connections: int
    reserve_fds: int
    lowered: bool  # max_connections is below what the config asked for


def raise_fd_limit() -> FdLimit:
    """Raise the soft RLIMIT_NOFILE to the hard one (getrlimit(2)); never fails.

    systemd leaves services at 1024 soft so that select(2) users stay safe
    and expects a daemon that needs more to raise its own soft limit
    (systemd.exec(5), LimitNOFILE=). An unlimited hard limit is left alone:
    Linux refuses a soft limit above fs.nr_open (setrlimit(2), EPERM).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard in (resource.RLIM_INFINITY, soft):
        return FdLimit(soft, soft, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as err:
        return FdLimit(soft, soft, hard, error=str(err))
    return FdLimit(soft, hard, hard)


def current_soft_limit() -> int:
    """The soft RLIMIT_NOFILE now (getrlimit(2))."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def plan_fd_budget(max_connections: int, soft_limit: int) -> FdBudget:
    """`max_connections` (api.max_connections), lowered so that connections plus
    the reserve fit under `soft_limit`; at least 1 (pure)."""
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        return FdBudget(max_connections, MIN_FD_RESERVE, False)
    reserve = max(MIN_FD_RESERVE, soft_limit // FD_RESERVE_SHARE)
    fits = max(1, soft_limit - reserve)
    cap = min(max_connections, fits)
    return FdBudget(cap, reserve, cap < max_connections)


def log_fd_limit(limit: FdLimit) -> None:
    """One line at start: the soft RLIMIT_NOFILE the daemon runs with, and whence."""
    log.info(
        "fd limit %s",
        format_fields(
            soft_before=limit.soft_before,
            soft=limit.soft,
            hard=limit.hard,
            error=limit.error,
            action="raise" if limit.soft != limit.soft_before else "keep",
        ),
    )
