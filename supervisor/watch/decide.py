"""The check loop's policy: one process's observation -> what to do (pure, no I/O).

`decide(slot, seen, state, policy, now)` turns what one pass saw of one
process into a `Decision`: thread binds, memory migrations, an IRQ re-write,
the findings (and which are new, to count once), notes, and the next
`RepairState` (supervisor.watch.settle folds what the binds did into it).
One process here is a supervised process with its whole tree: the threads of
its tree's members come in the same observation, each with its `pid`, and
are decided as its own (tids are unique host-wide while they live). The
migration policy lives here: the start threshold, repair to
`REPAIR_TARGET_RATIO` once started, the no-gain backoff and the tug-of-war
backoff. Nothing here imports bind/, run/, serve/ or the daemon.

Counting. A finding counts in drift_events{rank,kind} when it appears, not on
every pass while it persists; one that goes away and comes back counts again.
A thread never seen on its role's CPUs (new, or renamed into another role) is
not drift: binding it is the thread-role binding of a new thread, counted in
rebinds{reason="thread_role"}.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from supervisor.cpulist import format_cpulist
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Slot
from supervisor.procfs.identity import ProcessId, ThreadId
from supervisor.state import (
    DRIFT_KINDS,
    Finding,
    Observation,
    RebindReason,
    ThreadObservation,
)
from supervisor.watch.drift import apply_policy, process_findings, target_id, thread_findings
from supervisor.watch.fight import Fight, fights_on, held
from supervisor.watch.policy import THREAD_KINDS, Action, Policy

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
# A repair (started by a memory_locality finding) goes on to this ratio: the
# threshold says when to act, not where to stop (numad works alike).
REPAIR_TARGET_RATIO = 0.99


# -- inputs ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Seen:
    """One process as this pass's scan found it."""

    key: ProcKey
    pid: int
    observation: Observation
    memory_read: bool  # memory was read this pass (numa_maps or the cgroup's numa_stat)
    # MPOL_BIND to its slot's nodes since birth (the shim, or the start-up hook
    # before its code ran): memory_locality "auto" only observes such a process.
    bound_from_birth: bool = False


@dataclass(frozen=True, slots=True)
class MoveRecord:
    """A process's last memory migration (what the tug-of-war rule looks at)."""

    from_nodes: tuple[int, ...]
    to_nodes: tuple[int, ...]
    at: float  # monotonic


@dataclass(frozen=True, slots=True)
class ThreadCheck:
    """One pass's thread findings and what they were computed from. The scanner
    returns the same threads tuple while nothing changed (watch.observe), so
    the next pass reuses the findings by identity instead of a walk per thread."""

    slot: Slot
    threads: tuple[ThreadObservation, ...]
    bound: Mapping[int, tuple[int, ...]]
    pinned_ok: bool
    drift: tuple[Finding, ...]  # drift.thread_findings
    pinned: tuple[Finding, ...]  # _pinned_by_us

    def holds_for(
        self,
        slot: Slot,
        threads: tuple[ThreadObservation, ...],
        bound: Mapping[int, tuple[int, ...]],
        pinned_ok: bool,
    ) -> bool:
        return (
            self.threads is threads
            and self.bound is bound
            and self.pinned_ok == pinned_ok
            and (self.slot is slot or self.slot == slot)
        )


@dataclass(frozen=True, slots=True)
class RepairState:
    """What the loop remembers of one process between passes (replaced, never mutated)."""

    placed: Mapping[int, str] = field(default_factory=dict)  # tid -> role, seen/bound right
    bound: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # tid -> CPUs we set
    reported: frozenset[tuple[str, str]] = frozenset()  # (kind, target) already counted
    threads: tuple[ThreadObservation, ...] | None = None  # the last pass's threads
    failures: Mapping[tuple[str, str], str] = field(default_factory=dict)  # (target, id) -> reason
    migrate_after: float = 0.0  # monotonic; no migration before
    migrated_from: float | None = None  # ratio before the last migration, until re-read
    last_move: MoveRecord | None = None
    repairing: bool = False  # a memory_locality finding started a repair
    memory_stale: bool = False  # re-read memory at the next pass
    thread_check: ThreadCheck | None = None  # the last pass's thread findings
    fights: Mapping[str, Fight] = field(default_factory=dict)  # "tid 42"/"cgroup": repairs undone


def after_replan(state: RepairState) -> RepairState:
    """A process the new plan moved: its memory and threads are to be read afresh."""
    return replace(state, memory_stale=True, threads=None, migrated_from=None, thread_check=None)


# -- outputs --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThreadBind:
    tid: int
    name: str
    role: str
    cpus: tuple[int, ...]
    reason: RebindReason
    id: ThreadId | None = None  # the thread the scan saw (a reused tid is not it)
    pid: int | None = None  # the tree member it runs in; None: the decision's process


@dataclass(frozen=True, slots=True)
class MemoryMove:
    pid: int
    from_nodes: tuple[int, ...]
    to_nodes: tuple[int, ...]
    remote_bytes: int
    ratio: float
    reason: RebindReason
    # > 0: move at most this many bytes of private pages this pass (move_pages,
    # chunked; shared pages stay); 0: everything at once (migrate_pages(2)).
    max_bytes: int = 0


@dataclass(frozen=True, slots=True)
class CgroupRepair:
    """Make the process's own cgroup as planned again (re-made where removed) and
    put its processes back in: the main pid first, then its tree's members."""

    cpus: tuple[int, ...]
    mems: tuple[int, ...]
    pids: tuple[int, ...]
    reason: Literal["api", "cgroup"] = "cgroup"


@dataclass(frozen=True, slots=True)
class Note:
    """Something decided that is worth an event (and a log line), counted nowhere."""

    kind: Literal["migrate"]
    message: str
    log_message: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    key: ProcKey
    pid: int
    observation: Observation
    findings: tuple[Finding, ...]
    new_drift: tuple[Finding, ...]  # findings to count (first seen)
    binds: tuple[ThreadBind, ...] = ()
    moves: tuple[MemoryMove, ...] = ()
    irq_reason: RebindReason | None = None  # re-write this process's drifted IRQs
    notes: tuple[Note, ...] = ()
    cgroup: CgroupRepair | None = None  # before the thread binds: they need its cpuset
    state: RepairState = field(default_factory=RepairState)
    # (pid, start time) to move into the process's cgroups, before any bind (adoption)
    joins: tuple[ProcessId, ...] = ()


def has_work(d: Decision) -> bool:
    """Whether `d` writes anything: without it `Applier.apply` makes no syscall for it."""
    return bool(d.binds or d.moves or d.joins or d.cgroup is not None or d.irq_reason is not None)


# -- deciding -------------------------------------------------------------------------


def decide(
    slot: Slot,
    seen: Seen,
    state: RepairState,
    policy: Policy,
    now: float,
    *,
    others: Mapping[ProcKey, MoveRecord] | None = None,
) -> Decision:
    """What to do about one process this pass (`now`: monotonic seconds).

    `others`: the other processes' last migrations (the tug-of-war rule).
    """
    obs = seen.observation
    stale = state.memory_stale and not seen.memory_read
    check = _thread_check(slot, obs, state, pinned_ok=not policy.enforce_pinned)
    actions: dict[str, Action] = {
        kind: policy.action(kind, seen.bound_from_birth) for kind in DRIFT_KINDS
    }
    findings = apply_policy(
        check.drift + process_findings(slot, obs, threshold=policy.threshold) + check.pinned,
        actions,
    )
    w = _Work(seen.key, state, stale, now)
    threads = {t.tid: t for t in obs.threads} if findings else {}
    drift_tids: set[int] = set()
    reported: set[tuple[str, str]] = set()
    binds: list[ThreadBind] = []
    moves: list[MemoryMove] = []
    irq_reason: RebindReason | None = None
    cgroup: CgroupRepair | None = None
    conflicts: list[Finding] = []
    for f in findings:
        if f.kind in THREAD_KINDS:
            tid = target_id(f)
            thread = threads.get(tid) if tid is not None else None
            if tid is None or thread is None:
                continue
            drift_tids.add(tid)
            is_drift = state.placed.get(tid) == thread.role
            # A thread never seen on its role's CPUs is bound as a new thread
            # (a thread_role rebind), not counted as drift; under observe
            # nothing binds it, so there it is drift all the same. (A new
            # plan's binds are no drift either: see `reported` below.)
            if is_drift or f.action != "enforce":
                reported.add((f.kind, f.target))
            # POST /rebind (cause "api") is the operator's call: it binds through a back-off.
            fought = is_drift and f.action == "enforce" and policy.cause == "check"
            if fought and held(f, f.target, state.fights, now, conflicts):
                continue  # backing off: re-binding now would only lose again
            if f.action == "enforce":
                reason: RebindReason = (
                    "api"
                    if policy.cause == "api"
                    else "cpuset_changed"
                    if policy.cause == "cpuset_changed"
                    else "thread_affinity"
                    if is_drift
                    else "thread_role"
                )
                cpus = tuple(sorted(set(slot.role_cpus(thread.role))))
                binds.append(
                    ThreadBind(tid, thread.name, thread.role, cpus, reason, thread.id, thread.pid)
                )
            continue
        if policy.cause == "cpuset_changed":
            continue  # the pass after the re-plan reports the rest
        reported.add((f.kind, f.target))
        if f.kind == "memory_locality" and f.action == "enforce":
            w.repairing = True
            move = _plan_move(seen, slot, w, policy, others or {}, force=policy.force)
            if move is not None:
                moves.append(move)
        elif f.kind == "irq_affinity" and f.action == "enforce":
            irq_reason = "api" if policy.force else "irq_affinity"
        elif f.kind == "cgroup" and f.action == "enforce" and cgroup is None:
            if policy.cause == "check" and held(f, "cgroup", state.fights, now, conflicts):
                continue
            members = sorted({t.pid for t in obs.threads if t.pid is not None} - {seen.pid})
            cgroup = CgroupRepair(
                tuple(sorted(set(slot.cpus))),
                tuple(sorted(set(slot.mems))),
                (seen.pid, *members),
                "api" if policy.force else "cgroup",
            )
    if policy.cause == "cpuset_changed":
        reported = set(state.reported)
        if policy.move_memory and slot.mems:  # no node: its memory is left alone
            moves.append(
                MemoryMove(
                    seen.pid,
                    tuple(sorted(set(policy.node_ids) - set(slot.mems))),
                    tuple(sorted(slot.mems)),
                    0,
                    0.0,
                    "cpuset_changed",
                )
            )
    elif (w.repairing or _follows(policy, actions)) and not any(
        f.kind == "memory_locality" for f in findings
    ):
        move = _continue_repair(seen, slot, w, policy, actions=actions, others=others or {})
        if move is not None:
            moves.append(move)
    findings = findings + tuple(conflicts)
    reported.update(("conflict", f.target) for f in conflicts)
    new_drift = tuple(f for f in findings if (f.kind, f.target) in reported - state.reported)
    if policy.cause != "cpuset_changed":
        _judge_migration(obs, w)
    return Decision(
        seen.key,
        seen.pid,
        obs,
        findings,
        new_drift,
        tuple(binds),
        tuple(moves),
        irq_reason,
        tuple(w.notes),
        cgroup=cgroup,
        state=RepairState(
            placed=_placed(state, obs, drift_tids),
            bound=_live(state.bound, obs, state.threads),
            reported=frozenset(reported),
            threads=obs.threads,
            failures=state.failures,
            migrate_after=w.migrate_after,
            migrated_from=w.migrated_from,
            last_move=state.last_move,
            repairing=w.repairing,
            memory_stale=stale,
            thread_check=check,
            fights=fights_on(state.fights, drift_tids, findings),
        ),
    )


def _thread_check(
    slot: Slot, obs: Observation, state: RepairState, *, pinned_ok: bool
) -> ThreadCheck:
    """The thread findings of `obs`: the last pass's when it saw the same threads
    (the same tuple), the same slot and the same binds of ours; else computed."""
    last = state.thread_check
    if last is not None and last.holds_for(slot, obs.threads, state.bound, pinned_ok):
        return last
    return ThreadCheck(
        slot,
        obs.threads,
        state.bound,
        pinned_ok,
        thread_findings(slot, obs.threads, pinned_ok=pinned_ok),
        _pinned_by_us(slot, obs, state),
    )


@dataclass(slots=True)
class _Work:
    """The migration fields while one decision is made (local, then frozen)."""

    key: ProcKey
    migrate_after: float
    migrated_from: float | None
    repairing: bool
    stale: bool
    now: float
    last_move: MoveRecord | None
    notes: list[Note]

    def __init__(self, key: ProcKey, state: RepairState, stale: bool, now: float) -> None:
        self.key = key
        self.migrate_after = state.migrate_after
        self.migrated_from = state.migrated_from
        self.repairing = state.repairing
        self.stale = stale
        self.now = now
        self.last_move = state.last_move
        self.notes = []


def _pinned_by_us(slot: Slot, obs: Observation, state: RepairState) -> tuple[Finding, ...]:
    """Threads narrowed inside their role's CPUs by our own last bind, not by the
    workload: the pinned rule protects the workload's choices, never a stale one
    of ours (a bind made just before a CPU came back, then a new plan's wider set)."""
    if not state.bound:
        return ()
    out: list[Finding] = []
    wanted: dict[str, tuple[int, ...]] = {}
    for t in obs.threads:
        if state.bound.get(t.tid) != t.cpus:
            continue
        want = wanted.get(t.role)
        if want is None:
            want = wanted[t.role] = tuple(sorted(set(slot.role_cpus(t.role))))
        if t.cpus != want and set(t.cpus) < set(want):
            out.append(
                Finding(
                    "thread_affinity", f"tid {t.tid}", format_cpulist(want), format_cpulist(t.cpus)
                )
            )
    return tuple(out)


def _placed(state: RepairState, obs: Observation, drift_tids: set[int]) -> Mapping[int, str]:
    """Threads found on their role's CPUs (or respected as pinned) count as
    placed: leaving them later is drift. The same mapping when nothing changed."""
    if state.threads is not None and not drift_tids and obs.threads == state.threads:
        return state.placed
    placed = dict(state.placed)
    for t in obs.threads:
        if t.tid not in drift_tids:
            placed[t.tid] = t.role
    if len(placed) > len(obs.threads):
        live = {t.tid for t in obs.threads}
        placed = {tid: role for tid, role in placed.items() if tid in live}
    return placed


def _live(
    bound: Mapping[int, tuple[int, ...]],
    obs: Observation,
    previous: tuple[ThreadObservation, ...] | None,
) -> Mapping[int, tuple[int, ...]]:
    """`bound` without the threads that are gone (the same mapping when none is).
    The same threads tuple as the last pass's (`previous`) has lost none."""
    if not bound or obs.threads is previous:
        return bound
    live = {t.tid for t in obs.threads}
    if all(tid in live for tid in bound):
        return bound
    return {tid: cpus for tid, cpus in bound.items() if tid in live}


def _follows(policy: Policy, actions: Mapping[str, Action]) -> bool:
    """memory_locality "auto" enforced: a process whose policy is not ours to set
    (adopted, the engine) keeps taking pages off its nodes, and a repair waiting
    for the ratio to fall below the threshold would leave up to a tenth of them
    there for good; its remote pages are moved whenever it is below the repair
    target, as long as they are worth a walk."""
    return (
        policy.actions.get("memory_locality") == "auto" and actions["memory_locality"] == "enforce"
    )


def _continue_repair(
    seen: Seen,
    slot: Slot,
    w: _Work,
    policy: Policy,
    *,
    actions: Mapping[str, Action],
    others: Mapping[ProcKey, MoveRecord],
) -> MemoryMove | None:
    """Above the threshold again: move what is still remote until the repair
    target is reached (pages the process kept allocating remotely while the
    first migration ran, say). Only under the configured policy, never the API's."""
    if policy.cause != "check" or actions.get("memory_locality") != "enforce" or w.stale:
        return None
    ratio = seen.observation.local_memory_ratio
    if ratio is None or ratio >= REPAIR_TARGET_RATIO:
        w.repairing = False  # repaired
        return None
    # A repair goes on whatever the floor; following (no repair) only moves
    # what is worth a walk of the page tables.
    floor = 0 if w.repairing else MIGRATE_MIN_REMOTE_BYTES
    return _plan_move(seen, slot, w, policy, others, force=False, floor_bytes=floor)


def _plan_move(
    seen: Seen,
    slot: Slot,
    w: _Work,
    policy: Policy,
    others: Mapping[ProcKey, MoveRecord],
    *,
    force: bool,
    floor_bytes: int = MIGRATE_MIN_REMOTE_BYTES,
) -> MemoryMove | None:
    obs = seen.observation
    now = w.now
    if policy.migrate_max_bytes_per_s <= 0 or (now < w.migrate_after and not force) or w.stale:
        return None
    mems = set(slot.mems)
    remote = {n: b for n, b in obs.memory_bytes_by_node.items() if n not in mems and b > 0}
    if not mems or not remote or obs.local_memory_ratio is None:
        return None
    if sum(remote.values()) < floor_bytes and not force:
        return None
    # A tug of war: this process moved pages here, another moved pages the
    # other way since, and now they are remote again: pages both map (shared
    # libraries, shared memory). Do not pull them back.
    mine = w.last_move
    for other, theirs in sorted(others.items(), key=lambda kv: key_label(kv[0])):
        recent = (
            mine is not None
            and other != seen.key
            and mine.at < theirs.at
            and now - mine.at < MIGRATE_NO_GAIN_BACKOFF_S
        )
        if (
            recent
            and not force
            and set(theirs.from_nodes) & mems
            and set(theirs.to_nodes) & set(remote)
        ):
            w.migrate_after = now + MIGRATE_NO_GAIN_BACKOFF_S
            w.notes.append(
                Note(
                    "migrate",
                    f"{key_label(seen.key)}: not migrating: {key_label(other)} just moved "
                    f"pages the other way (pages both map); next try in "
                    f"{MIGRATE_NO_GAIN_BACKOFF_S:g}s",
                    None,
                    {"other": key_label(other)},
                )
            )
            return None
    if force:
        return MemoryMove(
            seen.pid,
            tuple(sorted(remote)),
            tuple(sorted(mems)),
            sum(remote.values()),
            obs.local_memory_ratio,
            "api",
        )
    # The loop's own moves: this pass's share of the rate, private pages only.
    share = max(int(policy.migrate_max_bytes_per_s * policy.check_interval_s), 1)
    return MemoryMove(
        seen.pid,
        tuple(sorted(remote)),
        tuple(sorted(mems)),
        min(sum(remote.values()), share),
        obs.local_memory_ratio,
        "memory_locality",
        max_bytes=share,
    )


def _judge_migration(obs: Observation, w: _Work) -> None:
    """After a migration and a fresh memory read: did the ratio rise? If not, back off."""
    before = w.migrated_from
    after = obs.local_memory_ratio
    if before is None or w.stale or after is None:
        return
    w.migrated_from = None
    if after >= before + MIGRATE_MIN_GAIN:
        return
    w.migrate_after = max(w.migrate_after, w.now + MIGRATE_NO_GAIN_BACKOFF_S)
    w.notes.append(
        Note(
            "migrate",
            f"{key_label(w.key)}: memory migration did not help "
            f"(local ratio {before:.3f} -> {after:.3f}); "
            f"next try in {MIGRATE_NO_GAIN_BACKOFF_S:g}s",
            "migrate no gain",
            {
                "before": before,
                "after": after,
                "action": f"wait {MIGRATE_NO_GAIN_BACKOFF_S:g}s",
            },
        )
    )


def without_moved(d: Decision, members: frozenset[int]) -> Decision:
    """`d` without the binds and moves of tree members no longer its process's
    (`members`: the tree now, the decision's own pid aside). A worker adopted
    between the scan and the binds sits in its rank's cpuset: binding it to
    the engine's CPUs fails with EINVAL (sched_setaffinity(2)) and would undo
    the adoption where the CPUs overlap."""
    binds = tuple(b for b in d.binds if b.pid is None or b.pid == d.pid or b.pid in members)
    moves = tuple(m for m in d.moves if m.pid == d.pid or m.pid in members)
    if len(binds) == len(d.binds) and len(moves) == len(d.moves):
        return d
    return replace(d, binds=binds, moves=moves)
