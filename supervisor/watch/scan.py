"""One check pass's reads (blocking: run in the daemon's executor; I/O through HostFS).

`track(...)` says which processes to read (and keeps one `Tracked` per
process, with one scanner per member of its tree as the tree keeper
published it in `Snapshot.trees`: no /proc walk here); `scan(...)` reads,
for each `ScanTarget`, the threads of the process and of every member of its
tree (through their `observe.ThreadScanner`s; a member's threads carry its
pid and join its owner's observation, contracts §7), its resident memory per node (its cgroup's
memory.numa_stat when it has one, else numa_maps when due), its own cgroup
as it is now (removed? its cpuset as written?), its planned IRQs
(through the IRQ keeper), and the supervisor's own allowed CPUs and nodes
with the online CPUs. It returns an immutable `ScanResult`; the loop decides
on it (supervisor.watch.decide). `read_allowed` is the allowed set alone
(the fast cpuset watch reads it on fixture trees).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from supervisor.bind.cgroup import CgroupManager, ProcessCgroup
from supervisor.errors import Gone, KernelError, SupervisorError
from supervisor.events import FactLike
from supervisor.hostfs import HostFS
from supervisor.plan.keys import ProcessKind, ProcKey
from supervisor.plan.placement import Placement, Slot
from supervisor.plan.replan import AllowedSet, normalize_allowed
from supervisor.plan.threads import RoleMatcher, role_kinds
from supervisor.procfs.identity import ProcessId
from supervisor.state import (
    IrqObservation,
    Observation,
    Supervised,
    ThreadObservation,
    TreeMember,
)
from supervisor.topology.cgroup import CpusetCache
from supervisor.topology.model import EngineScope
from supervisor.watch.decide import RepairState, Seen
from supervisor.watch.observe import (
    ThreadScanner,
    observe_process,
    read_online_cpus,
    read_self_allowed,
)
from supervisor.watch.steady import SteadyMark


class IrqOutcomeLike(Protocol):
    """One IRQ re-write (supervisor.watch.irqs.IrqOutcome)."""

    @property
    def irq(self) -> int: ...
    @property
    def status(self) -> str: ...
    @property
    def cpus(self) -> tuple[int, ...]: ...


class IrqKeeperLike(Protocol):
    """What the loop needs of `supervisor.watch.irqs.IrqKeeper` (blocking; run in the executor)."""

    def observe(self, placement: Placement) -> Mapping[ProcKey, tuple[IrqObservation, ...]]: ...

    def enforce(self, key: ProcKey, placement: Placement) -> Sequence[IrqOutcomeLike]: ...

    def apply(self, placement: Placement) -> object: ...

    def take_facts(self) -> Sequence[FactLike]: ...


# A rank cgroup's memory.numa_stat is read every this many checks (and at once
# after a migration or a new plan): locality moves slowly, the read was a tenth
# of a quiet pass (issue 17, item 6); between reads the last ratio stands.
NUMA_STAT_EVERY = 5


@dataclass(frozen=True, slots=True)
class MemberScan:
    """One member of a tree and the scanner kept for it."""

    id: ProcessId
    scanner: ThreadScanner

    @property
    def pid(self) -> int:
        return self.id.pid


@dataclass(slots=True)
class Tracked:
    """What the loop keeps of one process between passes (loop-owned; one per pid)."""

    pid: int
    id: ProcessId | None  # who runs at `pid` (ProcessStatus.id); None: unknown, any is it
    scanner: ThreadScanner
    matcher: RoleMatcher
    kind: ProcessKind
    members: dict[int, MemberScan] = field(default_factory=dict)  # the rest of its tree
    previous: Observation | None = None  # memory carried over when none is read
    maps_at: float = float("-inf")  # monotonic time of the last memory read
    state: RepairState = field(default_factory=RepairState)
    steady: SteadyMark | None = None  # the last pass decided nothing (watch.steady)
    # The last pass's tree threads: the per-process tuples and their concatenation,
    # handed back while every part is the same tuple (decide then skips its walk).
    tree_threads: tuple[
        tuple[tuple[ThreadObservation, ...], ...], tuple[ThreadObservation, ...]
    ] = (
        (),
        (),
    )


@dataclass(frozen=True, slots=True)
class ScanTarget:
    """One running process to read this pass."""

    key: ProcKey
    pid: int
    slot: Slot
    tracked: Tracked
    cgroup: ProcessCgroup | None  # read its memory.numa_stat
    read_maps: bool  # else: numa_maps is due
    members: tuple[MemberScan, ...] = ()  # the rest of its tree: threads only
    own: ProcessCgroup | None = None  # its own cgroup: is it still as made?
    bound_from_birth: bool = False  # MPOL_BIND to its slot since birth (decide.Seen)


def sync_members(
    fs: HostFS, members: dict[int, MemberScan], tree: Iterable[TreeMember]
) -> tuple[MemberScan, ...]:
    """Keep one scanner per member of `tree` (no I/O): a new pid, or the same pid
    with another start time (reused), gets a new one; members gone are dropped."""
    live: dict[int, MemberScan] = {}
    for m in tree:
        known = members.get(m.pid)
        if known is None or known.id != m.id:
            known = MemberScan(m.id, ThreadScanner(fs, m.pid, member=True))
        live[m.pid] = known
    if live.keys() != members.keys() or any(members[p] is not v for p, v in live.items()):
        members.clear()
        members.update(live)
    return tuple(live.values())


def track(
    fs: HostFS,
    tracked: dict[ProcKey, Tracked],
    matchers: Mapping[tuple[ProcessKind, ...], RoleMatcher],
    supervised: Iterable[Supervised],
    made: Mapping[ProcKey, ProcessCgroup],
    *,
    only: ProcKey | None,
    numa_maps_interval_s: float,
    now: float,
    trees: Mapping[ProcKey, Sequence[TreeMember]] | None = None,
    numa_stat_interval_s: float = 0.0,
) -> list[ScanTarget]:
    """The running processes to scan (no I/O). Starts tracking a process anew
    when its pid or start time changed (a restart, or a reused pid), and
    forgets the ones no longer running. `matchers` by `role_kinds`; `trees`:
    the members of each process's tree (`Snapshot.trees`). Memory is read
    when due: a process in its own memory cgroup every `numa_stat_interval_s`
    (memory.numa_stat), any other every `numa_maps_interval_s` (numa_maps);
    either at once when its state says the last reading is stale."""
    targets: list[ScanTarget] = []
    live: set[ProcKey] = set()
    for key, status, slot in supervised:
        if (only is not None and key != only) or status.state != "running" or status.pid is None:
            continue
        live.add(key)
        t = tracked.get(key)
        matcher = matchers[role_kinds(key, status.adopted)]
        if t is None or t.pid != status.pid or t.id != status.id:
            kind: ProcessKind = "engine" if key == "engine" else "workers"
            t = Tracked(status.pid, status.id, ThreadScanner(fs, status.pid), matcher, kind)
            tracked[key] = t
        t.matcher = matcher
        members = sync_members(fs, t.members, (trees or {}).get(key, ()))
        own = made.get(key) if status.cgroup is not None else None
        pc = own if own is not None and own.memory_dir is not None else None
        every = numa_maps_interval_s if pc is None else numa_stat_interval_s
        due = t.state.memory_stale or now - t.maps_at >= every
        stat = pc if due else None
        birth = status.mempolicy == "bind"
        targets.append(
            ScanTarget(key, status.pid, slot, t, stat, pc is None and due, members, own, birth)
        )
    if only is None:
        for key in list(tracked):
            if key not in live:
                del tracked[key]
    return targets


@dataclass(frozen=True, slots=True)
class ScanResult:
    allowed: AllowedSet | None
    host_error: str | None
    seen: Mapping[ProcKey, Seen | None]  # None: the process is gone
    errors: Mapping[ProcKey, str]
    irq_error: str | None
    member_errors: Mapping[ProcKey, tuple[tuple[int, str], ...]] = field(default_factory=dict)


def read_allowed(
    fs: HostFS,
    node_ids: Iterable[int],
    cache: CpusetCache | None = None,
    scope: EngineScope | None = None,
) -> AllowedSet:
    """The allowed CPUs (online ones) and nodes, as discovery computes them: the
    supervisor's own, or in attach mode those of the engine's cgroup (`scope`).

    Two small reads and the cgroup's cpuset files (found again only when
    `cache` says so): what a cpuset write or a hotplug changes. Raises
    SupervisorError or OSError when unreadable.
    """
    cpus, mems = read_self_allowed(fs, cache, scope)
    return normalize_allowed(cpus, mems, read_online_cpus(fs), node_ids)


def scan(
    fs: HostFS,
    targets: Sequence[ScanTarget],
    *,
    node_ids: Iterable[int],
    irqs: IrqKeeperLike | None,
    cgroups: CgroupManager | None,
    placement: Placement | None = None,
    with_allowed: bool = True,
    cpuset_cache: CpusetCache | None = None,
    membership_every: int = 1,
    scope: EngineScope | None = None,
) -> ScanResult:
    """Every read of one pass; failures isolated per process, the IRQs (of
    `placement`, the plan in force) and the host."""
    allowed: AllowedSet | None = None
    host_error: str | None = None
    if with_allowed:
        try:
            allowed = read_allowed(fs, node_ids, cpuset_cache, scope)
        except (SupervisorError, OSError) as err:
            host_error = str(err)
    irq_obs: Mapping[ProcKey, tuple[IrqObservation, ...]] = {}
    irq_error: str | None = None
    if irqs is not None and placement is not None:
        try:
            irq_obs = irqs.observe(placement)
        except Exception as err:  # the IRQ keeper's failure is not the processes'
            irq_error = f"{type(err).__name__}: {err}"
    seen: dict[ProcKey, Seen | None] = {}
    errors: dict[ProcKey, str] = {}
    member_errors: dict[ProcKey, tuple[tuple[int, str], ...]] = {}
    for t in targets:
        numa_stat: dict[int, int] | None = None
        if t.cgroup is not None and cgroups is not None:
            try:
                numa_stat = cgroups.read_numa_stat(t.cgroup)
            except KernelError:
                numa_stat = None  # fall back to the previous value
        try:
            observation = observe_process(
                fs,
                t.pid,
                t.slot,
                t.tracked.kind,
                scanner=t.tracked.scanner,
                matcher=t.tracked.matcher,
                numa_stat=numa_stat,
                numa_maps=t.read_maps,
                previous=t.tracked.previous,
            )
        except Gone:
            seen[t.key] = None
            continue
        except KernelError as err:
            errors[t.key] = str(err)
            continue
        threads, delivered, own = observation.threads, observation.irqs, observation.cgroup
        if t.members:
            parts, failed = scan_members(fs, t.members, t.tracked.matcher)
            threads = tree_threads(t.tracked, (threads, *parts))
            if failed:
                member_errors[t.key] = failed
        delivered = irq_obs.get(t.key, delivered)
        if t.own is not None and cgroups is not None:
            try:
                own = cgroups.observe(t.own, t.pid, membership_every=membership_every)
            except KernelError as err:
                member_errors[t.key] = (*member_errors.get(t.key, ()), (t.pid, str(err)))
        if (
            threads is not observation.threads
            or delivered is not observation.irqs
            or own is not None
        ):
            # One constructor, not dataclasses.replace (~5x its cost) per part.
            observation = Observation(
                threads,
                observation.memory_bytes_by_node,
                observation.local_memory_ratio,
                delivered,
                observation.observed_at,
                own,
            )
        read = t.read_maps or t.cgroup is not None
        seen[t.key] = Seen(t.key, t.pid, observation, read, t.bound_from_birth)
    return ScanResult(allowed, host_error, seen, errors, irq_error, member_errors)


def tree_threads(
    tracked: Tracked, parts: tuple[tuple[ThreadObservation, ...], ...]
) -> tuple[ThreadObservation, ...]:
    """The threads of a process and its tree's members in one tuple: the last
    pass's very tuple while every part is the one its scanner handed back then."""
    last_parts, last = tracked.tree_threads
    if len(parts) == len(last_parts) and all(
        a is b for a, b in zip(parts, last_parts, strict=True)
    ):
        return last
    threads = tuple(t for part in parts for t in part)
    tracked.tree_threads = (parts, threads)
    return threads


def scan_members(
    fs: HostFS, members: Sequence[MemberScan], matcher: RoleMatcher
) -> tuple[tuple[tuple[ThreadObservation, ...], ...], tuple[tuple[int, str], ...]]:
    """The threads of a tree's members (a tuple per member, each thread labelled
    with its pid), and the members that could not be read (pid, error). A member is read only while
    its pid is the process the tree keeper saw (its start time: one small read
    of its main thread's stat); one that exited or whose pid was reused since
    is skipped: the keeper drops it at its next pass."""
    threads: list[tuple[ThreadObservation, ...]] = []
    failed: list[tuple[int, str]] = []
    for m in members:
        try:
            if not m.id.leads(fs):
                continue
            threads.append(m.scanner.observe(matcher))
        except Gone:
            continue
        except KernelError as err:
            failed.append((m.pid, str(err)))
    return tuple(threads), tuple(failed)
