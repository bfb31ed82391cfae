"""The check loop: keep live placement true to the plan (does I/O: /proc, syscalls, cgroupfs).

Every `drift.check_interval_s` one pass (`Checker.check_once`):

1. Scan, in the daemon's executor: each running process's threads (one
   `observe.ThreadScanner` per pid), its resident memory per node (its own
   cgroup's memory.numa_stat when it has one, else /proc/<pid>/numa_maps
   every `numa_maps_interval_s`), the planned IRQs (through an `IrqKeeper`),
   and the supervisor's own allowed CPUs/nodes and the online CPUs.
2. A changed allowed set (cpuset write, CPU hotplug) re-plans first
   (`supervisor.plan.replan`), then re-binds the processes that moved, then scans
   again.
3. Diff each process against its slot (`drift.diff`), mark findings by
   `[drift.policy]`, enforce in the executor, publish observations, findings,
   counters and events in the `StateStore` (on the loop: the single writer).

Counting. A finding is counted in `drift_events{rank,kind}` and gets one
event when it appears, not on every check while it persists; one that goes
away and comes back counts again. A thread that was never seen on its role's
CPUs (new, or renamed into another role) is not drift: binding it is the
thread-role binding of a new thread, counted in `rebinds{rank,"thread_role"}`.
`rebinds{rank,reason}` counts threads re-bound (reason: the drift kind,
"thread_role", "cpuset_changed", or "api" for POST /rebind), memory
migrations and IRQ re-writes (one per IRQ). A bind failure counts in
`bind_failures{rank,target,reason}` once per target while it keeps failing
the same way (it is retried every check); a thread that exits between the
scan and the bind is not a failure. Events are grouped per process and kind
within one pass, naming the targets.

cgroup v1 note: the kernel refuses (EBUSY) to shrink a v1 cpuset below the
CPUs of any child cpuset (Documentation/admin-guide/cgroup-v1/cpusets.rst,
"the CPUs of a cpuset must be a subset of its parent's"), and the per-rank
cgroups are children of the supervisor's. Whoever shrinks the supervisor's
v1 cpuset must shrink its descendants first (deepest first, each to its CPUs
∩ the new set, or the new set when that is empty), as container runtimes
do; the daemon then re-plans and sets each rank's cgroup to its new slot.
On growth the daemon widens its instance dir before the rank cgroups.
On v1 every cpuset write resets the affinity of the cgroup's tasks to the
whole new set; cgroup v2 since Linux 6.2 keeps a task's own affinity where
it still fits. Either way the loop re-applies the thread roles afterwards.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from supervisor.bind.binder import Binder
from supervisor.bind.cgroup import CgroupManager, ProcessCgroup
from supervisor.config import DriftConfig, DriftPolicy, discovery_options
from supervisor.cpulist import format_cpulist
from supervisor.errors import Gone, KernelError, SupervisorError, translate_oserror
from supervisor.logs import format_fields
from supervisor.plan.placement import Placement, Slot
from supervisor.plan.replan import (
    AllowedSet,
    Replan,
    allowed_of,
    changed_keys,
    mems_changed,
    merge_topology,
    normalize_allowed,
    replan,
    same_processes,
    slots_by_key,
)
from supervisor.plan.threads import (
    DEFAULT_THREAD_ROLES,
    ProcessKind,
    RoleMatcher,
    plan_thread_affinity,
)
from supervisor.state import (
    HOST_LABEL,
    Finding,
    IrqObservation,
    Observation,
    ProcKey,
    key_label,
)
from supervisor.topology.discover import read_topology
from supervisor.topology.model import Topology
from supervisor.watch.drift import apply_policy, diff, target_id
from supervisor.watch.observe import (
    ThreadScanner,
    observe_process,
    read_online_cpus,
    read_self_allowed,
)

if TYPE_CHECKING:
    from supervisor.daemon import Daemon

log = logging.getLogger("placement_supervisor.checker")

MIGRATE_NO_GAIN_BACKOFF_S = 60.0  # a migration that did not raise the ratio waits this long
MIGRATE_MIN_GAIN = 0.01  # ...where "raise" means by at least this much
# Remote memory below this is not migrated by the loop (the finding stays):
# not worth a walk of the worker's page tables under its mmap lock. The
# ratio counts only memory the process allocated, so shared library pages
# (which migrate_pages(2) with CAP_SYS_NICE moves too) no longer make two
# ranks on different nodes take them back and forth; a floor sized for that
# (it was 32 MiB) left a small worker a third remote for good. The API's
# rebind ignores the floor.
MIGRATE_MIN_REMOTE_BYTES = 4 << 20
# A repair (started by a memory_locality finding) goes on to this ratio.
REPAIR_TARGET_RATIO = 0.99
EVENT_TARGETS_MAX = 20  # targets named in one grouped event
ENFORCED_KINDS = ("thread_affinity", "memory_locality", "irq_affinity", "self_rebind")


def _more_suffix(total: int, shown: int) -> str:
    """The " (+N more)" of an event that names only the first `shown` of `total` targets."""
    return f" (+{total - shown} more)" if total > shown else ""


class IrqKeeperLike(Protocol):
    """What the loop needs of `supervisor.watch.irqs.IrqKeeper` (blocking; run in the executor).

    The keeper reports its own re-writes (events) and failures
    (bind_failures{target="irq"}); the daemon builds it with
    `count_rebinds=False`, so the loop counts rebinds{reason="irq_affinity"}
    per IRQ the keeper says it re-wrote ("bound"), like every other re-bind.
    """

    def observe(self) -> Mapping[ProcKey, tuple[IrqObservation, ...]]: ...

    def enforce(self, key: ProcKey) -> Iterable[object]: ...

    def replan(self, placement: Placement, topology: Topology | None = None) -> object: ...


class CgroupsLike(Protocol):
    """The parts of `daemon.ManagedCgroups` the loop reads (numa_stat) and updates."""

    manager: CgroupManager
    made: dict[ProcKey, ProcessCgroup]

    def create(self, key: ProcKey, slot: Slot) -> tuple[str, ...]: ...


# -- what one pass works on (frozen, handed to the executor) ------------------------


@dataclass(frozen=True, slots=True)
class ScanTarget:
    key: ProcKey
    pid: int
    slot: Slot
    cgroup: ProcessCgroup | None  # read its memory.numa_stat
    read_maps: bool  # else: numa_maps is due


@dataclass(frozen=True, slots=True)
class ScanResult:
    allowed: AllowedSet | None
    host_error: str | None
    observed: Mapping[ProcKey, Observation | None]  # None: the process is gone
    errors: Mapping[ProcKey, str]
    irqs: Mapping[ProcKey, tuple[IrqObservation, ...]]
    irq_error: str | None


@dataclass(frozen=True, slots=True)
class ThreadBind:
    key: ProcKey
    tid: int
    name: str
    role: str
    cpus: tuple[int, ...]
    reason: str  # thread_affinity (drift), thread_role (new thread), cpuset_changed, api


@dataclass(frozen=True, slots=True)
class MemoryMove:
    key: ProcKey
    pid: int
    from_nodes: tuple[int, ...]
    to_nodes: tuple[int, ...]
    remote_bytes: int
    ratio: float
    reason: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one bind did: `kept` read back, or `error`, or the target was gone."""

    error: KernelError | None = None
    gone: bool = False
    kept: tuple[int, ...] = ()
    pages_left: int = 0
    irqs_bound: tuple[int, ...] = ()  # IRQs the keeper re-wrote


@dataclass(slots=True)
class Tracked:
    """What the loop remembers of one process between passes (loop-owned)."""

    pid: int
    start_time: int | None
    scanner: ThreadScanner
    matcher: RoleMatcher
    kind: ProcessKind
    previous: Observation | None = None
    maps_at: float = float("-inf")  # monotonic time of the last numa_maps read
    placed: dict[int, str] = field(default_factory=dict)  # tid -> role seen/bound correctly
    reported: set[tuple[str, str]] = field(default_factory=set)  # (kind, target) counted
    failures: dict[tuple[str, str], str] = field(default_factory=dict)  # (target kind, id)
    migrate_after: float = 0.0  # monotonic; no migration before
    migrated_from: float | None = None  # ratio before the last migration, until re-read
    # A memory_locality finding started a repair: keep migrating what is still
    # remote until REPAIR_TARGET_RATIO, even once back over the threshold.
    # The threshold says when to act, not where to stop (numad works alike).
    repairing: bool = False
    memory_stale: bool = False  # re-read memory at the next pass


@dataclass(slots=True)
class _Pass:
    """One process's share of a pass, between evaluation and publication."""

    key: ProcKey
    observation: Observation
    findings: list[Finding]
    new_drift: list[Finding]
    binds: list[ThreadBind] = field(default_factory=list)
    moves: list[MemoryMove] = field(default_factory=list)
    irq: bool = False  # enforce this process's IRQs
    irq_reason: str = "irq_affinity"  # "api" for POST /rebind


# -- the checker -----------------------------------------------------------------------


class Checker:
    """The check loop of one daemon; `run()` is its long-running task.

    Construct it once the daemon runs (it uses `daemon.runtime`). `check_once`
    and `rebind` may be called from the API while `run` loops: a lock keeps
    passes from overlapping (the scanners are not thread-safe).
    """

    def __init__(
        self,
        daemon: Daemon,
        *,
        irqs: IrqKeeperLike | None = None,
        binder: Binder | None = None,
    ) -> None:
        self.daemon = daemon
        self.rt = daemon.runtime
        self.store = daemon.store
        self.config = daemon.config
        self.drift: DriftConfig = daemon.config.drift
        # The daemon's keeper (it applies and restores IRQs) unless one is given.
        self.irqs: IrqKeeperLike | None = irqs if irqs is not None else daemon.irq_keeper
        self.binder = binder if binder is not None else Binder(self.rt.fs)
        self.roles = (*daemon.config.threads, *DEFAULT_THREAD_ROLES)
        self.matchers: dict[ProcessKind, RoleMatcher] = {
            "engine": RoleMatcher("engine", self.roles),
            "workers": RoleMatcher("workers", self.roles),
        }
        self.tracked: dict[ProcKey, Tracked] = {}
        self.down_reported: set[ProcKey] = set()
        self.allowed: AllowedSet = allowed_of(daemon.topology)
        self.lock = asyncio.Lock()
        self.replan_pending = False  # the allowed set changed and re-planning failed
        self._plan_error: str | None = None
        # This pass's observations and findings, published together at its end.
        self.results: dict[ProcKey, tuple[Observation, tuple[Finding, ...]]] = {}
        self.can_migrate_other = self.binder.can_migrate_other()
        self._last_error: str | None = None
        self._host_error: str | None = None
        self._irq_error: str | None = None
        # Each process's last migration: (from nodes, to nodes, monotonic time).
        self.recent_moves: dict[ProcKey, tuple[tuple[int, ...], tuple[int, ...], float]] = {}

    # -- the loop -----------------------------------------------------------

    async def run(self) -> None:
        """Check every `check_interval_s` until the daemon stops (cancelled at shutdown)."""
        interval = self.drift.check_interval_s
        if not self.can_migrate_other:
            log.info(
                "no CAP_SYS_NICE %s",
                format_fields(
                    effect="migrate_pages only for same-uid processes and unshared pages",
                    action="degrade",
                ),
            )
        next_at = time.monotonic()
        while not self.rt.stopping.is_set():
            try:
                await self.check_once()
                self._last_error = None
            except asyncio.CancelledError:
                raise
            except Exception as err:  # one bad pass must not end checking
                text = f"{type(err).__name__}: {err}"
                if text != self._last_error:
                    log.exception("check failed %s", format_fields(error=text, action="retry"))
                    self.store.emit("error", None, f"check failed: {text}", error=text)
                self._last_error = text
            next_at += interval
            now = time.monotonic()
            next_at = max(next_at, now)  # a slow pass skips the missed ticks, no burst
            await asyncio.sleep(next_at - now)

    async def rebind(self, rank: ProcKey | None) -> dict[str, Any]:
        """POST /rebind: one enforcing pass now (every kind enforced), for one rank or all."""
        if self.rt.stopping.is_set():
            raise SupervisorError("the supervisor is stopping")
        return await self.check_once(force=True, only=rank)

    async def check_once(
        self, *, force: bool = False, only: ProcKey | None = None
    ) -> dict[str, Any]:
        """One pass; returns a summary per process. `force` enforces every kind
        (the API's rebind, reason "api"); `only` limits it to one process."""
        async with self.lock:
            started = time.perf_counter()
            self.results.clear()
            try:
                summary = await self._check(force, only)
            finally:
                self.store.set_observations(self.results)  # the pass, as one snapshot
            duration = time.perf_counter() - started
            c = self.store.snapshot.counters
            self.store.update(
                counters=replace(
                    c,
                    checks=c.checks + 1,
                    check_seconds_sum=c.check_seconds_sum + duration,
                    last_check_duration_s=duration,
                    last_check_at=time.time(),
                )
            )
            return summary

    # -- one pass -------------------------------------------------------------

    async def _check(self, force: bool, only: ProcKey | None) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        ex = self.rt.executor
        targets = self._targets(only)
        scan = await loop.run_in_executor(ex, self._scan, targets)
        self._note_host(scan)
        changed = scan.allowed is not None and scan.allowed != self.allowed
        if changed or self.replan_pending:
            if changed:
                assert scan.allowed is not None
                await self._cpuset_changed(scan.allowed)
            else:
                await self._replan()  # the last re-plan failed: try again each pass
            targets = self._targets(only)
            scan = await loop.run_in_executor(ex, self._scan, targets)
        now = time.monotonic()
        passes: list[_Pass] = []
        for target in targets:
            tracked = self.tracked.get(target.key)
            if tracked is None or tracked.pid != target.pid:
                continue
            if target.key in scan.errors:
                self._fail(
                    target.key, "process", f"pid {target.pid}", "error", scan.errors[target.key]
                )
                continue
            observation = scan.observed.get(target.key)
            if observation is None:
                continue  # exited since the listing: its runner reports that
            if target.key in scan.irqs:
                observation = replace(observation, irqs=scan.irqs[target.key])
            if target.read_maps or target.cgroup is not None:
                tracked.maps_at = now
                tracked.memory_stale = False
            passes.append(self._evaluate(target, tracked, observation, force, now))
        binds = [b for p in passes for b in p.binds]
        moves = [m for p in passes for m in p.moves]
        irq_keys = [p.key for p in passes if p.irq]
        results = await loop.run_in_executor(ex, self._apply, binds, moves, irq_keys)
        summary: dict[str, Any] = {}
        for p in passes:
            summary[key_label(p.key)] = self._publish(p, results)
        summary.update(self._publish_down(only))
        return {"reason": "api" if force else "check", "processes": summary}

    def _targets(self, only: ProcKey | None) -> list[ScanTarget]:
        """Running processes to scan; (re)starts tracking on a new pid."""
        now = time.monotonic()
        targets: list[ScanTarget] = []
        live: set[ProcKey] = set()
        cgroups = self._cgroups()
        for runner in self.daemon.runners:
            key = runner.key
            status = runner.status
            if only is not None and key != only:
                continue
            if status.state != "running" or status.pid is None:
                continue
            live.add(key)
            tracked = self.tracked.get(key)
            if (
                tracked is None
                or tracked.pid != status.pid
                or tracked.start_time != status.start_time
            ):
                kind: ProcessKind = "engine" if key == "engine" else "workers"
                tracked = Tracked(
                    status.pid,
                    status.start_time,
                    ThreadScanner(self.rt.fs, status.pid),
                    self.matchers[kind],
                    kind,
                )
                self.tracked[key] = tracked
            pc: ProcessCgroup | None = None
            if cgroups is not None and status.cgroup is not None:
                made = cgroups.made.get(key)
                if made is not None and made.memory_dir is not None:
                    pc = made
            due = tracked.memory_stale or now - tracked.maps_at >= self.drift.numa_maps_interval_s
            targets.append(ScanTarget(key, status.pid, runner.spec.slot, pc, pc is None and due))
        if only is None:
            for key in list(self.tracked):
                if key not in live:
                    del self.tracked[key]
        return targets

    def _cgroups(self) -> CgroupsLike | None:
        cgroups = self.rt.cgroups
        if cgroups is None or not isinstance(getattr(cgroups, "manager", None), CgroupManager):
            return None
        return cgroups  # type: ignore[return-value]  # ManagedCgroups: checked above

    # -- executor side: reads ---------------------------------------------------

    def _scan(self, targets: Sequence[ScanTarget]) -> ScanResult:
        fs = self.rt.fs
        allowed: AllowedSet | None = None
        host_error: str | None = None
        try:
            cpus, mems = read_self_allowed(fs)
            online = read_online_cpus(fs)
            node_ids = {n.id for n in self.store.snapshot.topology.nodes}
            allowed = normalize_allowed(cpus, mems, online, node_ids)
        except (SupervisorError, OSError) as err:
            host_error = str(err)
        irqs: Mapping[ProcKey, tuple[IrqObservation, ...]] = {}
        irq_error: str | None = None
        if self.irqs is not None:
            try:
                irqs = self.irqs.observe()
            except Exception as err:  # the IRQ keeper's failure is not the processes'
                irq_error = f"{type(err).__name__}: {err}"
        cgroups = self._cgroups()
        observed: dict[ProcKey, Observation | None] = {}
        errors: dict[ProcKey, str] = {}
        for t in targets:
            tracked = self.tracked[t.key]
            numa_stat: dict[int, int] | None = None
            if t.cgroup is not None and cgroups is not None:
                try:
                    numa_stat = cgroups.manager.read_numa_stat(t.cgroup)
                except KernelError:
                    numa_stat = None  # fall back to the previous value
            try:
                observed[t.key] = observe_process(
                    fs,
                    t.pid,
                    t.slot,
                    tracked.kind,
                    scanner=tracked.scanner,
                    matcher=tracked.matcher,
                    numa_stat=numa_stat,
                    read_numa_maps=t.read_maps,
                    previous=tracked.previous,
                )
            except Gone:
                observed[t.key] = None
            except KernelError as err:
                errors[t.key] = str(err)
        return ScanResult(allowed, host_error, observed, errors, irqs, irq_error)

    def _note_host(self, scan: ScanResult) -> None:
        for attr, text, what in (
            ("_host_error", scan.host_error, "allowed CPUs"),
            ("_irq_error", scan.irq_error, "IRQs"),
        ):
            if text is not None and text != getattr(self, attr):
                log.warning(
                    "observe failed %s", format_fields(what=what, error=text, action="skip")
                )
                self.store.emit("error", None, f"cannot observe {what}: {text}", error=text)
            setattr(self, attr, text)

    # -- evaluation (on the loop, pure apart from `tracked`) ------------------------

    def _policy(self, force: bool) -> dict[str, DriftPolicy]:
        if force:
            return dict.fromkeys(ENFORCED_KINDS, "enforce")
        return dict(self.drift.policy)

    def _evaluate(
        self, target: ScanTarget, tracked: Tracked, obs: Observation, force: bool, now: float
    ) -> _Pass:
        slot = target.slot
        findings = list(
            apply_policy(
                diff(
                    slot,
                    obs,
                    threshold=self.drift.local_memory_threshold,
                    pinned_ok=not self.drift.enforce_pinned,
                ),
                self._policy(force),
            )
        )
        threads = {t.tid: t for t in obs.threads} if findings else {}
        drift_tids: set[int] = set()
        p = _Pass(target.key, obs, findings, [])
        reported: set[tuple[str, str]] = set()
        for f in findings:
            if f.kind in ("thread_affinity", "self_rebind"):
                tid = target_id(f)
                thread = threads.get(tid) if tid is not None else None
                if tid is None or thread is None:
                    continue
                drift_tids.add(tid)
                is_drift = tracked.placed.get(tid) == thread.role
                # A thread never seen on its role's CPUs is bound as a new
                # thread (a thread_role rebind), not counted as drift; under
                # observe nothing binds it, so there it is drift all the same.
                if is_drift or f.action != "enforce":
                    reported.add((f.kind, f.target))
                if f.action == "enforce":
                    reason = "api" if force else ("thread_affinity" if is_drift else "thread_role")
                    cpus = tuple(sorted(set(slot.role_cpus(thread.role))))
                    p.binds.append(
                        ThreadBind(target.key, tid, thread.name, thread.role, cpus, reason)
                    )
                continue
            reported.add((f.kind, f.target))
            if f.kind == "memory_locality" and f.action == "enforce":
                tracked.repairing = True
                move = self._plan_move(target, tracked, obs, now, force)
                if move is not None:
                    p.moves.append(move)
            elif f.kind == "irq_affinity" and f.action == "enforce":
                p.irq = True
                p.irq_reason = "api" if force else "irq_affinity"
        if tracked.repairing and not any(f.kind == "memory_locality" for f in findings):
            self._continue_repair(target, tracked, obs, now, p)
        p.new_drift = [f for f in findings if (f.kind, f.target) in reported - tracked.reported]
        tracked.reported = reported
        self._judge_migration(target.key, tracked, obs, now)
        # Threads found on their role's CPUs (or respected as pinned) count as
        # placed: leaving them later is drift. Skipped when nothing changed.
        prev = tracked.previous
        if prev is None or drift_tids or obs.threads != prev.threads:
            placed = tracked.placed
            for t in obs.threads:
                if t.tid not in drift_tids:
                    placed[t.tid] = t.role
            if len(placed) > len(obs.threads):
                live = {t.tid for t in obs.threads}
                tracked.placed = {tid: role for tid, role in placed.items() if tid in live}
        tracked.previous = obs
        return p

    def _continue_repair(
        self, target: ScanTarget, tracked: Tracked, obs: Observation, now: float, p: _Pass
    ) -> None:
        """Above the threshold again: move what is still remote until the repair
        target is reached (pages the process kept allocating remotely while the
        first migration ran, say)."""
        if self.drift.policy.get("memory_locality") != "enforce" or tracked.memory_stale:
            return
        ratio = obs.local_memory_ratio
        if ratio is None or ratio >= REPAIR_TARGET_RATIO:
            tracked.repairing = False  # repaired
            return
        move = self._plan_move(target, tracked, obs, now, False, floor_bytes=0)
        if move is not None:
            p.moves.append(move)

    def _plan_move(
        self,
        target: ScanTarget,
        tracked: Tracked,
        obs: Observation,
        now: float,
        force: bool,
        *,
        floor_bytes: int = MIGRATE_MIN_REMOTE_BYTES,
    ) -> MemoryMove | None:
        rate = self.drift.migrate_max_bytes_per_s
        if rate <= 0 or (now < tracked.migrate_after and not force) or tracked.memory_stale:
            return None
        mems = set(target.slot.mems)
        remote = {n: b for n, b in obs.memory_bytes_by_node.items() if n not in mems and b > 0}
        if not remote or obs.local_memory_ratio is None:
            return None
        if sum(remote.values()) < floor_bytes and not force:
            return None
        # A tug of war: this process moved pages here, another moved pages
        # the other way since, and now they are remote again: pages both map
        # (shared libraries, shared memory). Do not pull them back.
        mine = self.recent_moves.get(target.key)
        for other, (from_nodes, into, at) in self.recent_moves.items():
            recent = (
                mine is not None
                and other != target.key
                and mine[2] < at
                and now - mine[2] < MIGRATE_NO_GAIN_BACKOFF_S
            )
            if recent and not force and set(from_nodes) & mems and set(into) & set(remote):
                tracked.migrate_after = now + MIGRATE_NO_GAIN_BACKOFF_S
                self.store.emit(
                    "migrate",
                    target.key,
                    f"{key_label(target.key)}: not migrating: {key_label(other)} just moved "
                    f"pages the other way (pages both map); next try in "
                    f"{MIGRATE_NO_GAIN_BACKOFF_S:g}s",
                    other=key_label(other),
                )
                return None
        return MemoryMove(
            target.key,
            target.pid,
            tuple(sorted(remote)),
            tuple(sorted(mems)),
            sum(remote.values()),
            obs.local_memory_ratio,
            "api" if force else "memory_locality",
        )

    def _judge_migration(
        self, key: ProcKey, tracked: Tracked, obs: Observation, now: float
    ) -> None:
        """After a migration and a fresh memory read: did the ratio rise? If not, back off."""
        before = tracked.migrated_from
        if before is None or tracked.memory_stale or obs.local_memory_ratio is None:
            return
        tracked.migrated_from = None
        if obs.local_memory_ratio >= before + MIGRATE_MIN_GAIN:
            return
        tracked.migrate_after = max(tracked.migrate_after, now + MIGRATE_NO_GAIN_BACKOFF_S)
        label = key_label(key)
        message = (
            f"{label}: memory migration did not help (local ratio {before:.3f} -> "
            f"{obs.local_memory_ratio:.3f}); next try in {MIGRATE_NO_GAIN_BACKOFF_S:g}s"
        )
        self.store.emit("migrate", key, message, before=before, after=obs.local_memory_ratio)
        log.warning(
            "migrate no gain %s",
            format_fields(
                rank=label,
                before=f"{before:.3f}",
                after=f"{obs.local_memory_ratio:.3f}",
                action=f"wait {MIGRATE_NO_GAIN_BACKOFF_S:g}s",
            ),
        )

    # -- executor side: writes -----------------------------------------------------

    def _apply(
        self, binds: Sequence[ThreadBind], moves: Sequence[MemoryMove], irq_keys: Sequence[ProcKey]
    ) -> dict[object, Outcome]:
        """Every bind of a pass, each failure isolated to its thread, process or IRQ set."""
        results: dict[object, Outcome] = {}
        for b in binds:
            results[b] = self._bind_thread(b.tid, b.cpus)
        for m in moves:
            try:
                left = self.binder.migrate_pages(m.pid, m.from_nodes, m.to_nodes)
                results[m] = Outcome(pages_left=left)
            except Gone:
                results[m] = Outcome(gone=True)
            except KernelError as err:
                results[m] = Outcome(error=err)
        for key in irq_keys:
            results[("irq", key)] = self._enforce_irqs(key)
        return results

    def _bind_thread(self, tid: int, cpus: tuple[int, ...]) -> Outcome:
        try:
            kept = self.binder.set_thread_affinity(tid, cpus)
        except Gone:
            return Outcome(gone=True)
        except KernelError as err:
            return Outcome(error=err)
        if kept != frozenset(cpus):
            # sched_setaffinity(2) keeps only the CPUs the cpuset allows: a
            # partial bind is a failure, or the next pass would redo it forever.
            partial = translate_oserror(
                f"tid {tid}",
                OSError(
                    errno.EINVAL,
                    f"kernel kept CPUs {format_cpulist(kept)} of {format_cpulist(cpus)}"
                    " (outside the cgroup cpuset?)",
                ),
            )
            return Outcome(error=partial, kept=tuple(sorted(kept)))
        return Outcome(kept=tuple(sorted(kept)))

    def _enforce_irqs(self, key: ProcKey) -> Outcome:
        if self.irqs is None:
            return Outcome()
        try:
            outcomes = self.irqs.enforce(key)
        except KernelError as err:
            return Outcome(error=err)
        except Exception as err:  # the keeper's bug stays the keeper's
            return Outcome(
                error=KernelError(f"irqs of {key_label(key)}", OSError(errno.EIO, str(err)))
            )
        # IrqOutcome(irq, status, ...): the keeper already counted each one.
        bound = tuple(
            int(getattr(o, "irq", -1)) for o in outcomes if getattr(o, "status", None) == "bound"
        )
        return Outcome(irqs_bound=bound)

    # -- publication (on the loop: the store's single writer) -------------------------

    def _publish(self, p: _Pass, results: Mapping[object, Outcome]) -> dict[str, Any]:
        key = p.key
        tracked = self.tracked[key]
        fixed: set[str] = set()
        failed: set[str] = set()
        bound_by_reason: dict[str, list[ThreadBind]] = {}
        kept_by_tid: dict[int, tuple[int, ...]] = {}
        for b in p.binds:
            out = results.get(b, Outcome(gone=True))
            fail_key = ("thread", f"tid {b.tid}")
            if out.gone:
                fixed.add(f"tid {b.tid}")  # exited: nothing left to fix
                continue
            if out.error is not None:
                failed.add(f"tid {b.tid}")
                self._fail(
                    key, "thread", f"tid {b.tid} ({b.name})", out.error.reason, str(out.error)
                )
                continue
            tracked.failures.pop(fail_key, None)
            tracked.placed[b.tid] = b.role
            fixed.add(f"tid {b.tid}")
            kept_by_tid[b.tid] = out.kept
            bound_by_reason.setdefault(b.reason, []).append(b)
        for reason, done in bound_by_reason.items():
            self._rebound(key, reason, done)
        moved = 0
        for m in p.moves:
            out = results.get(m, Outcome(gone=True))
            if out.gone:
                continue
            if out.error is not None:
                failed.add("memory")
                why = str(out.error)
                if out.error.reason == "denied" and not self.can_migrate_other:
                    why += " (the supervisor lacks CAP_SYS_NICE)"
                self._fail(key, "memory", "memory", out.error.reason, why)
                continue
            tracked.failures.pop(("memory", "memory"), None)
            self._migrated(key, tracked, m, out.pages_left)
            moved += 1
        irq_rebound = 0
        if p.irq:
            out = results.get(("irq", key), Outcome())
            if out.error is not None:
                failed.update(f.target for f in p.findings if f.kind == "irq_affinity")
                self._fail(key, "irq", "irqs", out.error.reason, str(out.error))
            else:
                tracked.failures.pop(("irq", "irqs"), None)
                fixed.update(f"irq {irq}" for irq in out.irqs_bound)
                irq_rebound = len(out.irqs_bound)
                if irq_rebound:  # the keeper emitted one event per IRQ
                    self.store.count("rebinds", (key_label(key), p.irq_reason), irq_rebound)
        # What is still wrong after this pass: fixed findings go, failed ones say so.
        remaining = tuple(
            f if f.target not in failed else replace(f, action="failed")
            for f in p.findings
            if f.target not in fixed
        )
        observation = p.observation
        if kept_by_tid:
            observation = replace(
                observation,
                threads=tuple(
                    replace(t, cpus=kept_by_tid[t.tid]) if t.tid in kept_by_tid else t
                    for t in observation.threads
                ),
            )
        self._report_drift(key, p.new_drift, fixed, failed)
        self.results[key] = (observation, remaining)
        self.down_reported.discard(key)
        return {
            "pid": tracked.pid,
            "state": "running",
            "findings": [f.to_doc() for f in p.findings],
            "threads_rebound": len(kept_by_tid),
            "memory_migrations": moved,
            "irqs_rebound": irq_rebound,
            "failed": sorted(failed),
            "drift": [f.to_doc() for f in remaining],
        }

    def _publish_down(self, only: ProcKey | None) -> dict[str, Any]:
        """Planned processes that are not running: a process_gone finding, counted once."""
        out: dict[str, Any] = {}
        if self.rt.stopping.is_set():
            return out
        for runner in self.daemon.runners:
            key = runner.key
            if only is not None and key != only:
                continue
            status = runner.status
            if status.state not in ("backoff", "failed", "stopped"):
                continue
            finding = Finding("process_gone", "process", "running", status.state)
            label = key_label(key)
            if key not in self.down_reported:
                self.down_reported.add(key)
                self.store.count("drift_events", (label, "process_gone"))
                self.store.emit(
                    "drift",
                    key,
                    f"{label}: process not running ({status.state})",
                    drift="process_gone",
                    targets=["process"],
                    outcome="observe",
                )
            self.results[key] = (Observation(observed_at=time.time()), (finding,))
            out[label] = {"state": status.state, "findings": [finding.to_doc()]}
        return out

    def _report_drift(
        self, key: ProcKey, new: Sequence[Finding], fixed: set[str], failed: set[str]
    ) -> None:
        by_kind: dict[str, list[Finding]] = {}
        for f in new:
            by_kind.setdefault(f.kind, []).append(f)
        label = key_label(key)
        for kind, found in by_kind.items():
            self.store.count("drift_events", (label, kind), len(found))
            outcomes = {
                f.target: (
                    "failed" if f.target in failed else "fixed" if f.target in fixed else f.action
                )
                for f in found
            }
            shown = found[:EVENT_TARGETS_MAX]
            detail = "; ".join(
                f"{f.target} expected {f.expected} got {f.actual}: {outcomes[f.target]}"
                for f in shown
            )
            more = _more_suffix(len(found), len(shown))
            self.store.emit(
                "drift",
                key,
                f"{label}: {kind} drift: {detail}{more}",
                drift=kind,
                targets=[f.target for f in shown],
                expected=[f.expected for f in shown],
                actual=[f.actual for f in shown],
                outcome=[outcomes[f.target] for f in shown],
                count=len(found),
            )
            log.info(
                "drift %s",
                format_fields(
                    rank=label,
                    kind=kind,
                    count=len(found),
                    first=shown[0].target,
                    expected=shown[0].expected,
                    actual=shown[0].actual,
                    action=outcomes[shown[0].target],
                ),
            )

    def _rebound(self, key: ProcKey, reason: str, done: Sequence[ThreadBind]) -> None:
        label = key_label(key)
        self.store.count("rebinds", (label, reason), len(done))
        shown = done[:EVENT_TARGETS_MAX]
        names = ", ".join(f"{b.tid} ({b.name}) -> {b.role} {format_cpulist(b.cpus)}" for b in shown)
        more = _more_suffix(len(done), len(shown))
        self.store.emit(
            "rebind",
            key,
            f"{label}: re-bound {len(done)} thread(s) [{reason}]: {names}{more}",
            reason=reason,
            threads=len(done),
            tids=[b.tid for b in shown],
        )
        log.info(
            "rebind %s",
            format_fields(rank=label, reason=reason, threads=len(done), first=shown[0].tid),
        )

    def _migrated(self, key: ProcKey, tracked: Tracked, m: MemoryMove, pages_left: int) -> None:
        label = key_label(key)
        now = time.monotonic()
        rate = max(self.drift.migrate_max_bytes_per_s, 1)
        # migrate_pages(2) moves everything in one call; the rate limit holds
        # the next call off for as long as this one's bytes take at the rate.
        tracked.migrate_after = now + max(m.remote_bytes / rate, self.drift.check_interval_s)
        self.recent_moves[key] = (m.from_nodes, m.to_nodes, now)
        tracked.migrated_from = m.ratio
        tracked.memory_stale = True
        self.store.count("rebinds", (label, m.reason))
        self.store.emit(
            "rebind",
            key,
            f"{label}: migrated memory from node {format_cpulist(m.from_nodes)} to node "
            f"{format_cpulist(m.to_nodes)} ({m.remote_bytes >> 20} MiB remote, "
            f"ratio {m.ratio:.3f}; {pages_left} pages not moved)",
            reason=m.reason,
            from_nodes=list(m.from_nodes),
            to_nodes=list(m.to_nodes),
            remote_bytes=m.remote_bytes,
            pages_left=pages_left,
        )
        log.info(
            "migrate %s",
            format_fields(
                rank=label,
                pid=m.pid,
                from_nodes=format_cpulist(m.from_nodes),
                to_nodes=format_cpulist(m.to_nodes),
                remote_mib=m.remote_bytes >> 20,
                pages_left=pages_left,
            ),
        )

    def _fail(self, key: ProcKey, target: str, what: str, reason: str, message: str) -> None:
        """A bind failure: counted and reported once per `what` while it fails the same way.

        `what` names the thing ("tid 4242", "memory", "irqs", "cgroup"); the
        first word pair is its identity, any "(...)" after it is detail.
        """
        tracked = self.tracked.get(key)
        fail_key = (target, what.split(" (", maxsplit=1)[0])
        if tracked is not None:
            if tracked.failures.get(fail_key) == reason:
                return
            tracked.failures[fail_key] = reason
        label = key_label(key)
        self.store.count("bind_failures", (label, target, reason))
        self.store.emit(
            "bind_failed",
            key,
            f"{label}: {target} bind failed: {message}",
            target=target,
            reason=reason,
            what=what,
        )
        log.warning(
            "bind failed %s",
            format_fields(
                rank=label, target=target, what=what, reason=reason, error=message, action="retry"
            ),
        )

    # -- cpuset change ------------------------------------------------------------------

    async def _cpuset_changed(self, new: AllowedSet) -> None:
        old, self.allowed = self.allowed, new
        c = self.store.snapshot.counters
        self.store.update(counters=replace(c, cpuset_changes=c.cpuset_changes + 1))
        policy = self.drift.policy.get("cpuset_changed", "observe")
        message = (
            f"supervisor cpuset changed: cpus {format_cpulist(old.cpus)} -> "
            f"{format_cpulist(new.cpus)}, mems {format_cpulist(old.mems)} -> "
            f"{format_cpulist(new.mems)}"
        )
        self.store.emit(
            "cpuset",
            None,
            message,
            old_cpus=sorted(old.cpus),
            new_cpus=sorted(new.cpus),
            old_mems=sorted(old.mems),
            new_mems=sorted(new.mems),
            action="replan" if policy == "enforce" else "observe",
        )
        log.warning(
            "cpuset changed %s",
            format_fields(
                old_cpus=format_cpulist(old.cpus),
                new_cpus=format_cpulist(new.cpus),
                old_mems=format_cpulist(old.mems),
                new_mems=format_cpulist(new.mems),
                action="replan" if policy == "enforce" else "observe",
            ),
        )
        if policy == "enforce":
            await self._replan()

    async def _replan(self) -> None:

        loop = asyncio.get_running_loop()
        ex = self.rt.executor
        old = self.store.snapshot
        options = discovery_options(self.config, self.daemon.env)
        try:
            fresh = await loop.run_in_executor(ex, read_topology, self.rt.fs, options)
            result = replan(merge_topology(fresh, old.topology), self.config.placement)
        except SupervisorError as err:
            self._keep_plan(f"{err}")
            return
        if not same_processes(old.placement, result.placement):
            # Not a passing fault: retrying cannot change which devices exist.
            self._keep_plan("the new plan holds other processes than the running ones", retry=False)
            return
        if result.shortage is not None:
            text = (
                f"the new cpuset cannot hold the plan's minimums; planned with "
                f"on_shortage={result.shortage} ({'; '.join(result.degraded)})"
            )
            self.store.emit("plan", None, text, warning=True, on_shortage=result.shortage)
            log.warning("replan degraded %s", format_fields(on_shortage=result.shortage, why=text))
        moved = changed_keys(old.placement, result.placement)
        install_placement(self.daemon, result)
        self.replan_pending, self._plan_error = False, None
        self.store.emit(
            "plan",
            None,
            f"re-planned for cpus {format_cpulist(result.topology.allowed.cpus)}: "
            f"{', '.join(key_label(k) for k in moved) or 'no process'} moved",
            moved=[key_label(k) for k in moved],
            warnings=list(result.placement.warnings),
            shared=result.placement.shared,
        )
        if self.irqs is not None:
            try:
                await loop.run_in_executor(ex, self.irqs.replan, result.placement, result.topology)
            except Exception as irq_err:  # IRQs degrade alone
                self._fail_host("irq", f"IRQ re-plan failed: {irq_err}")
        slots = slots_by_key(result.placement)
        cgroup_failed = await loop.run_in_executor(ex, self._update_cgroups, slots, moved)
        for failed_key, cgroup_err in cgroup_failed:
            if failed_key is None:
                self._fail_host("cgroup", f"instance cgroup update failed: {cgroup_err}")
            else:
                self._fail(failed_key, "cgroup", "cgroup", cgroup_err.reason, str(cgroup_err))
        jobs: list[tuple[ProcKey, int, Slot, bool]] = []
        for key in moved:
            tracked = self.tracked.get(key)
            status = self.store.snapshot.processes.get(key)
            if tracked is None or status is None or status.pid != tracked.pid:
                continue
            in_cgroup = status.cgroup is not None and key not in {k for k, _ in cgroup_failed}
            migrate = mems_changed(old.placement, result.placement, key) and not in_cgroup
            jobs.append((key, tracked.pid, slots[key], migrate))
            tracked.memory_stale = True
            tracked.previous = None
            tracked.migrated_from = None
        results = await loop.run_in_executor(ex, self._rebind_moved, jobs)
        for key, binds, outcomes, move in results:
            self._record_moved(key, binds, outcomes, move)

    def _keep_plan(self, why: str, *, retry: bool = True) -> None:
        # Retried every pass until it succeeds (a read racing a hotplug, say);
        # said once per distinct reason, not once per pass.
        self.replan_pending = retry
        if why == self._plan_error:
            return
        self._plan_error = why
        self.store.emit(
            "plan_failed", None, f"re-plan failed: {why}; keeping the old plan", error=why
        )
        log.error("replan failed %s", format_fields(error=why, action="keep old plan, retry"))

    def _fail_host(self, target: str, message: str) -> None:
        self.store.count("bind_failures", (HOST_LABEL, target, "error"))
        self.store.emit("bind_failed", None, message, target=target, reason="error")
        log.warning("bind failed %s", format_fields(target=target, error=message, action="degrade"))

    def _update_cgroups(
        self, slots: Mapping[ProcKey, Slot], moved: Iterable[ProcKey]
    ) -> list[tuple[ProcKey | None, KernelError]]:
        """Instance dir (v1) to the new allowed set, then each moved process's cgroup."""
        cgroups = self._cgroups()
        if cgroups is None:
            return []
        failed: list[tuple[ProcKey | None, KernelError]] = []
        manager = cgroups.manager
        keys = [k for k in moved if k in cgroups.made]

        def update_children() -> None:
            for key in keys:
                if any(k == key for k, _ in failed):
                    continue
                try:
                    cgroups.create(key, slots[key])
                except KernelError as err:
                    failed.append((key, err))

        if manager.setup.version == 1 and cgroups.made:
            try:
                self._write_instance(manager)
            except KernelError:
                # Shrinking: the children must shrink first (v1 subset rule).
                update_children()
                try:
                    self._write_instance(manager)
                except KernelError as err:
                    failed.append((None, err))
        update_children()
        return failed

    def _write_instance(self, manager: CgroupManager) -> None:
        inst = manager.instance_dirs[0]
        # Mems first on growth, so the cpus write never meets an empty mems.
        for name, values in (
            ("cpuset.mems", self.allowed.mems),
            ("cpuset.cpus", self.allowed.cpus),
        ):
            rel = f"{inst}/{name}"
            try:
                manager.fs.write_text(rel, format_cpulist(values))
            except OSError as err:
                raise translate_oserror(manager.fs.path(rel), err) from None

    def _rebind_moved(
        self, jobs: Sequence[tuple[ProcKey, int, Slot, bool]]
    ) -> list[tuple[ProcKey, list[ThreadBind], dict[object, Outcome], MemoryMove | None]]:
        """Each moved process: every thread onto its role's CPUs of the new slot,
        then its pages onto the new nodes when no cgroup moves them."""
        out: list[tuple[ProcKey, list[ThreadBind], dict[object, Outcome], MemoryMove | None]] = []
        node_ids = {n.id for n in self.store.snapshot.topology.nodes}
        for key, pid, slot, migrate in jobs:
            tracked = self.tracked[key]
            threads = tracked.scanner.scan()
            actions = plan_thread_affinity(
                threads, slot, tracked.kind, self.roles, self.drift.enforce_pinned
            )
            binds = [
                ThreadBind(key, a.tid, a.name, a.role, a.cpus, "cpuset_changed") for a in actions
            ]
            outcomes: dict[object, Outcome] = {b: self._bind_thread(b.tid, b.cpus) for b in binds}
            move: MemoryMove | None = None
            if migrate:
                move = MemoryMove(
                    key,
                    pid,
                    tuple(sorted(node_ids - set(slot.mems))),
                    tuple(sorted(slot.mems)),
                    0,
                    0.0,
                    "cpuset_changed",
                )
                try:
                    outcomes[move] = Outcome(
                        pages_left=self.binder.migrate_pages(pid, move.from_nodes, move.to_nodes)
                    )
                except Gone:
                    outcomes[move] = Outcome(gone=True)
                except KernelError as err:
                    outcomes[move] = Outcome(error=err)
            out.append((key, binds, outcomes, move))
        return out

    def _record_moved(
        self,
        key: ProcKey,
        binds: Sequence[ThreadBind],
        outcomes: Mapping[object, Outcome],
        move: MemoryMove | None,
    ) -> None:
        tracked = self.tracked.get(key)
        done: list[ThreadBind] = []
        for b in binds:
            out = outcomes[b]
            if out.gone:
                continue
            if out.error is not None:
                self._fail(
                    key, "thread", f"tid {b.tid} ({b.name})", out.error.reason, str(out.error)
                )
                continue
            done.append(b)
            if tracked is not None:
                tracked.placed[b.tid] = b.role
        label = key_label(key)
        if done:
            self._rebound(key, "cpuset_changed", done)
        else:
            self.store.emit(
                "rebind",
                key,
                f"{label}: moved with the new plan; no thread needed a re-bind",
                reason="cpuset_changed",
                threads=0,
            )
        if move is not None:
            out = outcomes[move]
            if out.error is not None:
                self._fail(key, "memory", "memory", out.error.reason, str(out.error))
            elif not out.gone:
                self.store.count("rebinds", (label, "cpuset_changed"))
                self.store.emit(
                    "rebind",
                    key,
                    f"{label}: migrated memory to node {format_cpulist(move.to_nodes)} "
                    f"({out.pages_left} pages not moved)",
                    reason="cpuset_changed",
                    to_nodes=list(move.to_nodes),
                )


# -- wiring ------------------------------------------------------------------------------


def install_placement(daemon: Daemon, result: Replan) -> None:
    """Make a new plan the daemon's: restarts spawn into its slots, the API shows it."""
    daemon.replace_placement(result.placement, result.topology)


def make_check_loop(
    irqs: IrqKeeperLike | None = None,
    started: Callable[[Checker], None] | None = None,
) -> Callable[[Daemon], Awaitable[None]]:
    """A `daemon.CheckLoop` that runs a `Checker` (with `irqs` when given) and
    answers POST /rebind through it; `started` sees the checker (tests)."""

    async def loop(daemon: Daemon) -> None:
        checker = Checker(daemon, irqs=irqs)
        actions = getattr(daemon, "actions", None)
        if actions is not None and hasattr(actions, "rebinder"):
            actions.rebinder = checker.rebind
        if started is not None:
            started(checker)
        await checker.run()

    return loop


async def check_loop(daemon: Daemon) -> None:
    """The default check loop (no IRQ keeper)."""
    await make_check_loop()(daemon)
