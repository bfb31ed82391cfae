"""Process trees: who belongs to which supervised process, however deep (reads /proc).

A supervised process (the engine, a spawned or adopted worker) is a *root*;
its tree is every process found under it: the members of its cgroup
(cgroup.procs) where it has one, plus the /proc descendants (PPid chain) of
the root and of every member already known. `setsid` does not change a
parent, so torchrun's workers stay under torchrun; an orphan reparented to
the daemon (a child subreaper, prctl(2) PR_SET_CHILD_SUBREAPER) is no
longer under its owner by PPid, so a member, once seen, stays its owner's
until it exits. Processes are always pid + start time (/proc/PID/stat field 22).
`assign_owners` is pure; `read_member_info` reads /proc (the process table itself is
`supervisor.procfs.stat.scan_procs`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from supervisor.events import Recorder
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey
from supervisor.procfs.files import read_cmdline
from supervisor.procfs.identity import ProcessId
from supervisor.procfs.stat import ProcStat, children_map
from supervisor.state import StateStore, TreeMember

CMDLINE_MAX_CHARS = 512  # /placement shows this much of a member's command line


@dataclass(frozen=True, slots=True)
class Root:
    """One supervised process: the top of a tree."""

    key: ProcKey
    pid: int
    # Who it is; None until its start time is read (a spawned child is a root
    # from its fork, before its stat is read): any process at `pid` is it then.
    id: ProcessId | None
    cgroup_dir: str | None = None  # relative to the HostFS root; its cgroup.procs are members

    def is_in(self, table: Mapping[int, ProcStat]) -> bool:
        """True when `table` (the process table read now) holds this root."""
        stat = table.get(self.pid)
        return stat is not None and (self.id is None or self.id.matches(stat))


@dataclass(frozen=True, slots=True)
class Member:
    """One process of a tree other than its root."""

    id: ProcessId
    ppid: int
    owner: ProcKey

    @property
    def pid(self) -> int:
        return self.id.pid


def read_cgroup_procs(fs: HostFS, cgroup_dir: str) -> list[int]:
    """The pids in a cgroup (cgroup.procs); [] when it is gone.

    Streamed to EOF, a line a pid: a seq_file gives a page a read, and a tree of
    thousands of processes is tens of KB (issue 30: its first 4 KiB were ~700)."""
    try:
        return [int(line) for line in fs.iter_lines(f"{cgroup_dir}/cgroup.procs") if line.isdigit()]
    except OSError:
        return []


def assign_owners(
    table: Mapping[int, ProcStat],
    roots: Iterable[Root],
    known: Mapping[int, Member],
    cgroup_members: Mapping[ProcKey, Iterable[int]],
    *,
    exclude: Iterable[int] = (),
) -> dict[int, Member]:
    """Every live process of every tree other than the roots, with its owner (pure).

    Seeds, for each root: the root, its cgroup's members, and the members
    `known` from before that are still the same process (pid and start time).
    Each seed's /proc descendants join the seed's owner, without crossing into
    another root (an adopted worker is the root of its rank's tree, not a
    member of the engine's). Nothing in `exclude` (the daemon, its guardian)
    is ever a member.
    """
    roots = list(roots)
    root_pids = {r.pid: r for r in roots if r.is_in(table)}
    excluded = set(exclude)
    children = children_map(table)
    out: dict[int, Member] = {}
    visited: set[int] = set()

    def walk(seeds: Iterable[tuple[int, ProcKey]]) -> None:
        queue = list(seeds)
        while queue:
            pid, owner = queue.pop()
            stat = table.get(pid)
            if pid in visited or pid in excluded or stat is None:
                continue
            root = root_pids.get(pid)
            if root is not None and root.key != owner:
                continue  # another root's tree
            visited.add(pid)
            if root is None:
                out[pid] = Member(ProcessId.of(stat), stat.ppid, owner)
            queue.extend((child, owner) for child in children.get(pid, ()))

    # In this order, so that a process is its nearest root's: the /proc trees
    # of the roots first, then cgroup members (orphans included), then members
    # known from before whose parent has gone (reparented to the daemon).
    walk((r.pid, r.key) for r in roots if r.pid in root_pids)
    walk((pid, key) for key, pids in cgroup_members.items() for pid in pids)
    walk((pid, m.owner) for pid, m in known.items() if m.id.matches(table.get(pid)))
    return out


def descendants(members: Mapping[int, Member], pid: int) -> list[int]:
    """The members below `pid` by their parent links (pure)."""
    below: dict[int, list[int]] = {}
    for m in members.values():
        below.setdefault(m.ppid, []).append(m.pid)
    out: list[int] = []
    queue = list(below.get(pid, ()))
    while queue:
        child = queue.pop()
        if child in members and child not in out:
            out.append(child)
            queue.extend(below.get(child, ()))
    return out


def read_member_info(fs: HostFS, member: Member) -> TreeMember | None:
    """A member's command line and CPUs; None when it has exited."""
    cmdline = read_cmdline(fs, member.pid)
    if cmdline is None:
        return None
    try:
        cpus = tuple(sorted(os.sched_getaffinity(member.pid)))
    except OSError:
        return None
    return TreeMember(member.id, member.ppid, cmdline[:CMDLINE_MAX_CHARS], cpus)


# -- processes that cannot be read ------------------------------------------------------

READ_FAILURE_LOG_S = 60.0  # one line a minute at most, however many fail


class ReadFailures:
    """Processes whose /proc files are there but cannot be read (EACCES, EIO):
    each is skipped for its pass and counted (`placement_process_read_failures_total`);
    the log gets one line per READ_FAILURE_LOG_S with how many were held back.
    Called on the event loop (the store's one writer)."""

    def __init__(self, store: StateStore, logger: logging.Logger) -> None:
        self.recorder = Recorder(store, logger)
        self.log = logger
        self.next_log_at = 0.0
        self.held_back = 0

    def note(self, pid: int, error: object) -> None:
        self.recorder.process_read_failed()
        now = time.monotonic()
        if now < self.next_log_at:
            self.held_back += 1
            return
        self.log.warning(
            "process unreadable %s",
            format_fields(pid=pid, error=error, action="skip this pass", held_back=self.held_back),
        )
        self.held_back = 0
        self.next_log_at = now + READ_FAILURE_LOG_S


@dataclass(frozen=True, slots=True)
class RefreshResult:
    members: Mapping[int, Member]
    infos: Mapping[ProcKey, tuple[TreeMember, ...]]
    unreadable: tuple[tuple[int, str], ...] = ()  # (pid, error): skipped this pass


def without_new_roots(result: RefreshResult, roots: Iterable[Root]) -> RefreshResult:
    """A scan's result less the processes that became roots while it ran (a worker
    adopted meanwhile is its rank's root, never again a member of the engine's tree)."""
    now = {r.pid: r.key for r in roots}
    members = {p: m for p, m in result.members.items() if now.get(p, m.owner) == m.owner}
    infos = {
        key: tuple(i for i in items if now.get(i.pid, key) == key)
        for key, items in result.infos.items()
    }
    return RefreshResult(members, infos, result.unreadable)


def without_pids(
    trees: Mapping[ProcKey, tuple[TreeMember, ...]], pids: set[int]
) -> dict[ProcKey, tuple[TreeMember, ...]]:
    """Published trees less `pids` (processes being adopted: no owner's meanwhile)."""
    return {k: tuple(m for m in ms if m.pid not in pids) for k, ms in trees.items()}
