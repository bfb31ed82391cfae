"""The tree keeper: tracks every supervised process's tree, reaps orphans, ends trees (does I/O).

The daemon makes one `TreeKeeper`. Runners tell it their roots
(`set_root`); it learns members from the proc connector within
milliseconds (fork/exec/comm/exit, `supervisor.trees.proc_events`) where
the daemon may open it (while the trees are in cgroups, the kernel passes
only the events of the processes it lists), and from a /proc + cgroup.procs
pass (`supervisor.trees.tree.assign_owners`) every `interval_s` in any case:
read from the trees' cgroups alone while every root is in its own. It
publishes each tree into the snapshot (`/placement` "children"), reaps
orphans reparented to the daemon (a child subreaper: no zombies), tells
the guardian what to end if the daemon dies, hands engine-owned processes
to the adopter, and ends a tree on request: TERM, then KILL after a
timeout (`cgroup.kill` where cgroup v2 has it).

Over 500 lines: the pass, the connector's watch list, early forks waiting for their root
and the ending of trees share the roots and members; split, each piece would reach into
the others (pure parts and reaping: tree.py, quiet.py, strays.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from types import MappingProxyType

from supervisor.bind.syscalls import set_child_subreaper
from supervisor.errors import KernelError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey, key_label
from supervisor.procfs.identity import ProcessId
from supervisor.procfs.stat import read_proc_stat, scan_pids, scan_procs
from supervisor.state import StateStore, TreeMember
from supervisor.trees.guardian import Guardian
from supervisor.trees.proc_events import (
    PROC_EVENT_EXIT,
    PROC_EVENT_FORK,
    ProcEvents,
    RawEvent,
    nested_pid_namespace,
    open_proc_events,
)
from supervisor.trees.quiet import (
    LastPass,
    RecentProcs,
    cgroup_readings,
    fork_lineage,
    unchanged,
)
from supervisor.trees.strays import any_zombie_child, reap_members
from supervisor.trees.tree import (
    Member,
    ReadFailures,
    RefreshResult,
    Root,
    assign_owners,
    descendants,
    read_cgroup_procs,
    read_member_info,
    without_new_roots,
    without_pids,
)

log = logging.getLogger("placement_supervisor.trees")

END_POLL_S = 0.02
# Forks whose parent is in no tree yet are kept this long (and pruned past this many).
UNOWNED_FORKS_S = 5.0
UNOWNED_FORKS_KEPT = 4096  # how often an ending tree is looked at (a deadline-bounded poll)
# While every root sits in its own cgroup, a pass reads only those cgroups'
# members (a child is born in its parent's cgroup); every this many passes it
# walks all of /proc anyway, for a process someone moved out of our cgroups.
FULL_PASS_EVERY = 10
# With the proc connector open (no events lost since the last full pass) a member's
# fork is known at once: a full pass only for one moved out before that (1 a minute).
FULL_PASS_EVERY_WITH_EVENTS = 60
# A process forked in a tree becomes a member (a stat read, the guardian told,
# the adopter asked, the kernel filter rebuilt) at once on a quiet tree. When
# a tree forks more than STORM_FORKS_PER_S (engines fork compile workers,
# tokenizers and tool calls by the hundred a second, most gone in 1-10 ms), a
# fork becomes one only once it has lived STORM_SETTLE_S: the short-lived ones
# then cost one dict entry and one failed open each, and adoption during a
# storm waits that long (a worker's title comes seconds later anyway).
STORM_FORKS_PER_S = 50
STORM_SETTLE_S = 0.1


Adopter = Callable[[Member], None]


def open_events(fs: HostFS) -> tuple[ProcEvents | None, str]:
    """The proc connector for a tree keeper, or (None, why not)."""
    if nested_pid_namespace(fs.readlink("proc/self/ns/pid")):
        return None, "in a child pid namespace (a container): the connector reports host pids"
    return open_proc_events()


class TreeKeeper:
    """Every tree of one daemon. Call its methods from the event loop."""

    def __init__(
        self,
        fs: HostFS,
        store: StateStore,
        executor: Executor | None = None,
        *,
        interval_s: float | Callable[[], float],
        cgroup_dir: Callable[[ProcKey], str | None],
        direct_children: Callable[[], Iterable[int]],
        guardian: Guardian | None = None,
        events: ProcEvents | None = None,
        events_how: str | None = None,
        quiet_intervals: int = 1,
        subreaper: bool = True,
        adopter: Adopter | None = None,
        on_refresh: Callable[[Mapping[int, Member]], None] | None = None,
        recent_procs: RecentProcs | None = None,
    ) -> None:
        self.fs, self.store = fs, store
        self.read_failures = ReadFailures(store, log)
        # Its own thread by default: a loaded host's /proc pass never delays the daemon's.
        self._own_executor: ThreadPoolExecutor | None = None
        if executor is None:
            executor = self._own_executor = ThreadPoolExecutor(1, thread_name_prefix="ps-tree")
        self.executor = executor
        self.interval_of = interval_s if callable(interval_s) else lambda: float(interval_s)
        self.cgroup_dir = cgroup_dir
        self.direct_children = direct_children
        self.guardian = guardian
        # The proc connector (`open_events`), or None: forks seen at each pass only.
        # `events_how`: how it was opened, or why not (logged at start; None: not asked).
        self.events = events
        self.events_how = events_how
        self.roots: dict[ProcKey, Root] = {}
        self.adopted: set[ProcKey] = set()  # roots that are engine-spawned workers
        self.released: set[ProcKey] = set()  # trees never to end (release)
        self.leaving_pids: set[int] = set()  # being adopted: in no published tree meanwhile
        self.members: dict[int, Member] = {}
        self.adopter = adopter  # names the engine's processes ([workers] spawned_by = "engine")
        self.on_refresh = on_refresh  # after each pass, with every tree's members
        self.task: asyncio.Task[None] | None = None
        self.me = os.getpid()
        self.exited: dict[int, ProcessId] = {}  # members gone from the trees, maybe not reaped
        self.lineage: dict[int, ProcKey] = {}  # pid -> owner from fork events, until a pass
        self.births: dict[int, tuple[int, ProcKey, float]] = {}  # forks: pid -> (ppid, owner, t)
        self._settle_at: asyncio.TimerHandle | None = None
        self._forks_window = (0.0, 0)  # (window start, forks in it): the storm test
        self.unowned_forks: dict[int, tuple[int, float]] = {}  # in no tree: pid -> (ppid, t)
        self.subreaper = subreaper
        self._wake = asyncio.Event()
        self.passes = 0  # tree passes so far (ps-tree thread)
        self.full_passes = 0  # those that walked all of /proc
        self.in_cgroups = False  # at the last pass, every root was in a cgroup read
        self.recent_procs = recent_procs  # the check loop's cgroup.procs reads (quiet.py)
        # A quiet pass takes cgroup.procs readings this many intervals old: more than 1
        # where the check loop reads them every few checks (the daemon's, with events).
        self.quiet_intervals = quiet_intervals
        self._last: LastPass | None = None
        self._overruns = 0  # the connector's, at the last full pass

    # -- roots ---------------------------------------------------------------

    def set_root(
        self,
        key: ProcKey,
        pid: int,
        ident: ProcessId | None,
        *,
        adopted: bool = False,
        cgroup_dir: str | None = None,
    ) -> None:
        """`pid` is `key`'s root now. `cgroup_dir`: a cgroup that holds the root's
        tree, read (never written) for its members where the root has none of the
        daemon's: an attached engine's container (supervisor.trees.attach)."""
        own = self.cgroup_dir(key)
        self.roots[key] = Root(key, pid, ident, own if own is not None else cgroup_dir)
        self.released.discard(key)
        self.members.pop(pid, None)
        replayed = self._replay_forks(key, pid)
        if adopted:
            self.adopted.add(key)
            # Its descendants are the rank's now, not the engine's.
            moved = {pid, *self.descendants(pid)}
            for child in moved - {pid}:
                m = self.members[child]
                self.members[child] = Member(m.id, m.ppid, key)
            self._unpublish(moved)
            self.leaving_pids -= moved
        if self.guardian is not None and ident is not None:
            self.guardian.process(ident)
        self._watch()
        self._offer(replayed)
        self._wake.set()

    def leaving(self, pids: Sequence[int]) -> None:
        """`pids` are being adopted: out of the published trees now and kept out by
        every pass until `set_root` (gone ones are dropped). The check loop binds a
        tree's members to their owner's slot: listed as the engine's meanwhile (an
        adoption's page move takes seconds), the worker was bound back to the
        engine's CPUs, or refused them outside its rank's cpuset (EINVAL)."""
        self.leaving_pids.update(pids)
        self._unpublish(set(pids))

    def _unpublish(self, pids: set[int]) -> None:
        trees = self.store.snapshot.trees
        if any(m.pid in pids for members in trees.values() for m in members):
            self.store.update(trees=MappingProxyType(without_pids(trees, pids)))

    def clear_root(self, key: ProcKey) -> None:
        root = self.roots.pop(key, None)
        self.adopted.discard(key)
        if root is not None and self.guardian is not None:
            self.guardian.forget(root.pid)
        self._watch()

    def release(self, key: ProcKey) -> None:
        """Forget `key`'s tree and never end it: an attached engine's (trees.attach)."""
        self.released.add(key)
        self.clear_root(key)
        self.members = {p: m for p, m in self.members.items() if m.owner != key}

    def descendants(self, pid: int) -> list[int]:
        """Known members below `pid` by their parent links."""
        return descendants(self.members, pid)

    def owner_of(self, pid: int) -> ProcKey | None:
        for root in self.roots.values():
            if root.pid == pid:
                return root.key
        member = self.members.get(pid)
        return member.owner if member is not None else None

    # -- running -------------------------------------------------------------------

    def start(self, group: asyncio.TaskGroup | None = None) -> None:
        """The subreaper, the connector's reader, and the pass task (in `group`,
        the daemon's TaskGroup, where one is given)."""
        if self.subreaper:
            if set_child_subreaper():
                log.info("subreaper %s", format_fields(pid=self.me, action="orphans come back"))
            else:
                log.warning("subreaper refused %s", format_fields(action="orphans go to init"))
        if self.events is not None:
            self.events.attach(self._on_events)
        if (how := self.events_how) is not None:
            log.info(
                "process events %s",
                format_fields(
                    source=how if self.events else "checks only",
                    reason=None if self.events else how,
                    interval_s=f"{self.interval_of():g}",
                ),
            )
        spawn = asyncio.create_task if group is None else group.create_task
        self.task = spawn(self._loop(), name="tree_keeper")

    async def stop(self) -> None:
        if self._settle_at is not None:
            self._settle_at.cancel()
            self._settle_at = None
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
        self.reap()
        if self._own_executor is not None:
            self._own_executor.shutdown(wait=False)

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a bad pass must not end tracking
                log.exception("tree pass failed %s", format_fields(error=err, action="retry"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_of())
            self._wake.clear()

    async def refresh(self) -> RefreshResult:
        """One /proc + cgroup pass; publishes the trees and reaps zombies."""
        roots = tuple(self.roots.values())
        known = dict(self.members)
        last = None if self._full_due() else self._last  # its result, read nowhere, if it holds
        age_s = self.quiet_intervals * self.interval_of()  # of the config in force
        result = unchanged(last, roots, known, self.recent_procs, age_s)
        if result is not None:
            self.passes += 1
        else:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self.executor, self._scan, roots, known)
        if self.roots.keys() != {r.key for r in roots} or any(
            self.roots[r.key] != r for r in roots
        ):
            result = without_new_roots(result, self.roots.values())  # adopted meanwhile
        fresh = {pid: m for pid, m in result.members.items() if pid not in self.members}
        # Gone: known to the scan, not found (one an event added meanwhile is kept).
        gone = [pid for pid in known if pid not in result.members]
        # Events may have added members meanwhile: keep those the scan could not know.
        merged = dict(result.members)
        for pid, m in self.members.items():
            if pid not in merged and pid not in known:
                merged[pid] = m
        self.members = merged
        # Events up to this pass are applied: their short-lived parents are done.
        self.lineage.clear()
        cutoff = time.monotonic() - UNOWNED_FORKS_S
        self.unowned_forks = {c: (p, t) for c, (p, t) in self.unowned_forks.items() if t >= cutoff}
        self._watch()
        for pid in gone:
            self.exited[pid] = known[pid].id
        if self.guardian is not None:
            for pid in gone:
                self.guardian.forget(pid)
            for m in fresh.values():
                self.guardian.process(m.id)
        for pid, error in result.unreadable:
            self.read_failures.note(pid, error)
        self.leaving_pids &= result.members.keys()
        leaving = self.leaving_pids
        infos = without_pids(result.infos, leaving) if leaving else dict(result.infos)
        if dict(self.store.snapshot.trees) != infos:  # unchanged: keep the API's cache
            self.store.update(trees=MappingProxyType(infos))
        self.reap()
        if self.adopter is not None:
            for m in fresh.values():
                if m.owner == "engine":
                    self.adopter(m)
        if self.on_refresh is not None:
            self.on_refresh(self.members)
        return result

    def _full_due(self) -> bool:
        overruns = self.events.overruns if self.events is not None else 0
        every = FULL_PASS_EVERY if self.events is None else FULL_PASS_EVERY_WITH_EVENTS
        return self.passes % every == 0 or overruns != self._overruns

    def _scan(self, roots: Sequence[Root], known: Mapping[int, Member]) -> RefreshResult:
        cgroup_members = cgroup_readings(
            self.fs, roots, self.recent_procs, self.interval_of(), read_cgroup_procs
        )
        # Scoped when every root is in its cgroup: then every descendant is in
        # one of them too (fork(2) puts a child in its parent's cgroup,
        # cgroups(7)), and a pass is a few dozen reads instead of the host's
        # whole /proc, whatever else runs there.
        # A root in another's cgroup counts (an adopted worker in its attached
        # engine's container): its children are born there too.
        in_some = set().union(*cgroup_members.values())
        self.in_cgroups = all(r.pid in in_some for r in roots)
        scoped = self.in_cgroups and not self._full_due()
        self.passes += 1
        if scoped:
            pids = {r.pid for r in roots}.union(known, in_some)
            stats = scan_pids(self.fs, pids)
        else:
            self.full_passes += 1
            self._overruns = self.events.overruns if self.events is not None else 0
            stats = scan_procs(self.fs)
        # Zombies are done: they leave the trees (and are reaped as `exited`).
        table = {pid: s for pid, s in stats.items() if s.state != "Z"}
        exclude = {self.me, *(self.direct_children())}
        exclude -= {r.pid for r in roots}
        members = assign_owners(table, roots, known, cgroup_members, exclude=exclude)
        infos: dict[ProcKey, list[TreeMember]] = {}
        unreadable: list[tuple[int, str]] = []
        for m in sorted(members.values(), key=lambda m: m.pid):
            try:
                info = read_member_info(self.fs, m)
            except KernelError as err:  # there, but not readable: skip it this pass
                unreadable.append((m.pid, str(err)))
                continue
            if info is not None:
                infos.setdefault(m.owner, []).append(info)
        result = RefreshResult(members, {k: tuple(v) for k, v in infos.items()}, tuple(unreadable))
        self._last = LastPass(tuple(roots), cgroup_members, result) if scoped else None
        return result

    # -- events ----------------------------------------------------------------

    def _on_events(self, batch: list[RawEvent]) -> None:
        root_pids = {r.pid: r.key for r in self.roots.values()}
        members, lineage, births = self.members, self.lineage, self.births
        exited = False
        forks = 0
        now = time.monotonic()
        for what, pid, parent in batch:  # processes only: a thread inherits its binding
            if what == PROC_EVENT_FORK:
                if pid in members:
                    continue
                owner = root_pids.get(parent)
                if owner is None:
                    known = members.get(parent)
                    # A parent not settled yet, or one that exited before we could
                    # read it (the middle of a double fork), still passes its owner on.
                    owner = known.owner if known is not None else lineage.get(parent)
                if owner is None:
                    # Maybe a tree whose root is not known yet (its runner is
                    # still reading the shim's report): kept a while for it.
                    self._remember_fork(parent, pid)
                    continue
                lineage[pid] = owner
                births[pid] = (parent, owner, now)
                forks += 1
            elif what == PROC_EVENT_EXIT:
                gone = members.pop(pid, None)
                if gone is not None:
                    exited = True
                    self.exited[pid] = gone.id
                    if self.guardian is not None:
                        self.guardian.forget(pid)
            else:  # exec, comm: a new name
                known = members.get(pid)
                if known is not None and known.owner == "engine" and self.adopter is not None:
                    self.adopter(known)
        if forks:
            start, counted = self._forks_window
            self._forks_window = (start, counted + forks) if now - start < 1.0 else (now, forks)
        if births and self._settle_at is None:
            if self._storm(now):
                loop = asyncio.get_running_loop()
                self._settle_at = loop.call_later(STORM_SETTLE_S, self._settle_births)
            else:
                self._settle_births(0.0)
        if exited:
            # The exit event comes before the process is a zombie: reap a moment later.
            asyncio.get_running_loop().call_later(0.05, self.reap)

    def _storm(self, now: float) -> bool:
        start, forks = self._forks_window
        return now - start < 1.0 and forks > STORM_FORKS_PER_S

    def _settle_births(self, min_age_s: float = STORM_SETTLE_S) -> None:
        """Forks older than `min_age_s` become members (the filter then lists them).
        One read of their tree's cgroup.procs tells the live ones, if it has one
        (a storm's are nearly all gone: sorted out in comprehensions, not a step each)."""
        self._settle_at = None
        cutoff = time.monotonic() - min_age_s
        due = {
            pid: b for pid, b in self.births.items() if b[2] <= cutoff and pid not in self.members
        }
        self.births = {pid: b for pid, b in self.births.items() if b[2] > cutoff}
        alive: dict[ProcKey, frozenset[int] | None] = {}
        for owner in {b[1] for b in due.values()}:
            directory = self.cgroup_dir(owner) if owner in self.roots else None
            procs = None if directory is None else read_cgroup_procs(self.fs, directory)
            alive[owner] = frozenset(procs) if procs else None
        added: list[Member] = []
        for pid, (ppid, owner, _) in due.items():
            live = alive[owner]
            if live is not None and pid not in live:
                continue  # gone already; its children still find their owner (lineage)
            member = self._add_member(pid, ppid, owner)
            if member is not None:
                added.append(member)
        if added:
            self._watch()
            self._offer(added)
        if self.births:
            loop = asyncio.get_running_loop()
            self._settle_at = loop.call_later(STORM_SETTLE_S, self._settle_births)

    def _add_member(self, pid: int, ppid: int, owner: ProcKey) -> Member | None:
        self.lineage[pid] = owner
        stat = read_proc_stat(self.fs, pid)
        if stat is None:
            return None  # gone already; its children still find their owner (lineage)
        member = Member(ProcessId.of(stat), ppid, owner)
        self.members[pid] = member
        if self.guardian is not None:
            self.guardian.process(member.id)
        return member

    def _offer(self, members: Iterable[Member]) -> None:
        """New engine members to the adopter. After `_watch`: a process that
        execs before the filter lists it is named from /proc here, after it."""
        if self.adopter is None:
            return
        for member in members:
            if member.owner == "engine":
                self.adopter(member)

    def watched_pids(self) -> set[int]:
        """The processes whose forks (and exec/comm) the keeper acts on: the
        daemon, its children, the roots, the members, forks waiting for a root."""
        pids = {self.me, *self.direct_children(), *self.members, *self.unowned_forks}
        pids.update(r.pid for r in self.roots.values())
        return pids

    def _watch(self) -> None:
        """Have the kernel drop the events of the host's other processes, while
        the trees are in cgroups. Without them a double fork's orphan is found
        only through the fork event of its short-lived parent, which the
        kernel may send before the parent is listed: then all events are kept."""
        if self.events is not None:
            self.events.watch(self.watched_pids() if self.in_cgroups else None)

    def _remember_fork(self, parent: int, child: int) -> None:
        now = time.monotonic()
        self.unowned_forks[child] = (parent, now)
        if len(self.unowned_forks) > UNOWNED_FORKS_KEPT:
            cutoff = now - UNOWNED_FORKS_S
            self.unowned_forks = {
                c: (p, t) for c, (p, t) in self.unowned_forks.items() if t >= cutoff
            }

    def _replay_forks(self, key: ProcKey, pid: int) -> list[Member]:
        """Forks seen before `pid` became a root: its descendants join its tree."""
        added: list[Member] = []
        for child, parent in fork_lineage(self.unowned_forks, pid):
            self.unowned_forks.pop(child, None)
            if child not in self.members:
                member = self._add_member(child, parent, key)
                if member is not None:
                    added.append(member)
        return added

    # -- reaping -----------------------------------------------------------------

    def reap(self) -> int:
        """waitpid the daemon's exited children that were members of a tree
        (orphans it adopted as subreaper); never a runner's own child, never a
        process that was not in a tree (an embedding program's children)."""
        if not any_zombie_child():
            # Nothing to reap. The members gone are forgotten: one that is not a
            # zombie yet is reaped, once it is, as a stray (or by its parent).
            self.exited.clear()
            return 0
        candidates = dict(self.exited)
        candidates.update((m.pid, m.id) for m in self.members.values())
        direct = set(self.direct_children())
        reaped, gone = reap_members(self.fs, self.me, direct, candidates, strays=self.subreaper)
        for pid in gone:
            self.exited.pop(pid, None)
        for pid in reaped:
            self.exited.pop(pid, None)
            self.members.pop(pid, None)
        return len(reaped)

    # -- ending trees --------------------------------------------------------------

    def live_pids(self, keys: Iterable[ProcKey], *, roots: bool = False) -> dict[int, ProcessId]:
        """pid -> identity of every member (and with `roots`, root) owned by `keys`,
        plus whatever their cgroups hold now."""
        keys = set(keys)
        out = {m.pid: m.id for m in self.members.values() if m.owner in keys}
        for key in keys:
            root = self.roots.get(key)
            if roots and root is not None and root.id is not None:
                out[root.pid] = root.id
            directory = self.cgroup_dir(key)
            if directory is not None:
                for pid in read_cgroup_procs(self.fs, directory):
                    if pid != self.me and pid not in out:
                        stat = read_proc_stat(self.fs, pid)
                        if stat is not None:
                            out[pid] = ProcessId.of(stat)
        return out

    def tree_keys(self, key: ProcKey) -> set[ProcKey]:
        """`key` and, for the engine, every rank it spawned (adopted roots)."""
        keys = (key, *self.adopted) if key == "engine" else (key,)
        return {k for k in keys if k not in self.released}

    def signal_tree(self, key: ProcKey, sig: int, *, roots: bool = False) -> int:
        """Send `sig` to every live process of the tree (pid + start time checked)."""
        sent = 0
        direct = set(self.direct_children())
        for pid, ident in self.live_pids(self.tree_keys(key), roots=roots).items():
            if pid in direct or pid == self.me:
                continue  # a runner's own child is signalled through its pidfd
            if ident.send_signal(self.fs, sig):
                sent += 1
        return sent

    async def end_tree(self, key: ProcKey, timeout_s: float, *, roots: bool = True) -> int:
        """TERM every process of the tree, KILL what is left after `timeout_s`, reap.

        Returns how many were still there for the KILL."""
        keys = self.tree_keys(key)
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(self.executor, self._alive, keys, roots):
            return 0
        self.signal_tree(key, signal.SIGTERM, roots=roots)
        deadline = time.monotonic() + timeout_s
        left: dict[int, ProcessId] = {}
        while time.monotonic() < deadline:
            self.reap()
            left = await loop.run_in_executor(self.executor, self._alive, keys, roots)
            if not left:
                return 0
            await asyncio.sleep(END_POLL_S)
        killed = len(left)
        log.warning(
            "tree kill %s",
            format_fields(
                rank=key_label(key), pids=",".join(map(str, sorted(left))), action="SIGKILL"
            ),
        )
        for k in keys:
            directory = self.cgroup_dir(k)
            if directory is not None and self.fs.exists(f"{directory}/cgroup.kill"):
                with contextlib.suppress(OSError):
                    self.fs.write_text(f"{directory}/cgroup.kill", "1")
        self.signal_tree(key, signal.SIGKILL, roots=roots)
        kill_deadline = time.monotonic() + 2.0
        while time.monotonic() < kill_deadline:
            self.reap()
            if not await loop.run_in_executor(self.executor, self._alive, keys, roots):
                break
            await asyncio.sleep(END_POLL_S)
        return killed

    def _alive(self, keys: set[ProcKey], roots: bool) -> dict[int, ProcessId]:
        direct = set(self.direct_children())
        out = {}
        for pid, ident in self.live_pids(keys, roots=roots).items():
            if pid in direct:
                continue
            if ident.is_running(self.fs):
                out[pid] = ident
        return out
