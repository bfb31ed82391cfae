"""A quiet tree pass: no cgroup.procs read of its own while nothing changed (no I/O here).

The check loop reads each rank's cgroup.procs (is the process still in its
cgroup?); the tree keeper reads the same files. `cgroup_readings` takes the
loop's reading while it is younger than a check interval and reads only the
rest. `unchanged` says when the last scoped pass's result still holds, on a
reading up to the keeper's `quiet_age_s` old: one check interval, or, while
the proc connector reports the forks, the few checks between the loop's reads
(bind.cgroup.MEMBERSHIP_READ_EVERY; a fork below a root is an event, so only
a process someone else moved into a cgroup waits for the next read).
`fork_lineage` orders the forks seen before their root was known.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from supervisor.hostfs import HostFS
from supervisor.plan.keys import ProcKey
from supervisor.trees.tree import Member, RefreshResult, Root

RecentProcs = Callable[[str, float], "list[int] | None"]
"""(cgroup dir, max age in s) -> its cgroup.procs as read that recently, or None."""


@dataclass(frozen=True, slots=True)
class LastPass:
    """What the last scoped pass started from, and what it found."""

    roots: tuple[Root, ...]
    cgroup_members: Mapping[ProcKey, list[int]]
    result: RefreshResult


def cgroup_readings(
    fs: HostFS,
    roots: Sequence[Root],
    recent: RecentProcs | None,
    max_age_s: float,
    read: Callable[[HostFS, str], list[int]],
) -> dict[ProcKey, list[int]]:
    """Each root's cgroup.procs: the recent reading where there is one, else `read`."""
    out: dict[ProcKey, list[int]] = {}
    for root in roots:
        if root.cgroup_dir is None:
            continue
        pids = recent(root.cgroup_dir, max_age_s) if recent is not None else None
        out[root.key] = pids if pids is not None else read(fs, root.cgroup_dir)
    return out


def unchanged(
    last: LastPass | None,
    roots: Sequence[Root],
    known: Mapping[int, Member],
    recent: RecentProcs | None,
    max_age_s: float,
) -> RefreshResult | None:
    """`last`'s result when a scoped pass now would find the same: the same
    roots, each in its cgroup, every cgroup holding the same processes as then
    (a recent reading, no read here), and no member then or now. A member's
    command line and CPUs are published each pass, so a tree with members is
    always read; a tree of its root alone has nothing to read but that list
    (a child is born in its parent's cgroup, cgroups(7)). None: scan."""
    if last is None or recent is None:
        return None
    if known or last.result.members or last.roots != tuple(roots):
        return None
    for root in roots:
        if root.cgroup_dir is None:
            return None
        pids = recent(root.cgroup_dir, max_age_s)
        if pids is None or root.pid not in pids:
            return None
        if set(pids) != set(last.cgroup_members.get(root.key, ())):
            return None
    return last.result


def fork_lineage(forks: Mapping[int, tuple[int, float]], pid: int) -> list[tuple[int, int]]:
    """(child, parent) for every fork in `forks` (child -> (parent, time)) below
    `pid`, parents before their children (pure; the keeper's early forks)."""
    below: dict[int, list[int]] = {}
    for child, (parent, _) in forks.items():
        below.setdefault(parent, []).append(child)
    out: list[tuple[int, int]] = []
    queue = [(c, pid) for c in below.get(pid, ())]
    seen: set[int] = set()
    while queue:
        child, parent = queue.pop()
        if child in seen:
            continue
        seen.add(child)
        out.append((child, parent))
        queue.extend((c, child) for c in below.get(child, ()))
    return out
