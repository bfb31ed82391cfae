"""What the binds of a decision did, folded into the next repair state (pure, no I/O).

`settle(decision, outcomes, policy, now)` takes the `Outcomes` that
supervisor.watch.apply returned for one `decide.Decision` and says what to
record (threads re-bound by reason, migrations, new bind failures: each
failure is counted once while it keeps failing the same way) and what is
still wrong. A successful migration sets the rate-limit window and the
record the tug-of-war rule reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from supervisor.errors import KernelError
from supervisor.plan.placement import Slot
from supervisor.state import BindTarget, Finding, Observation, RebindReason
from supervisor.watch.decide import Decision, MemoryMove, MoveRecord, RepairState, ThreadBind
from supervisor.watch.fight import Fight
from supervisor.watch.policy import Policy


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one bind did: `kept` read back, or `error`, or the target was gone."""

    error: KernelError | None = None
    gone: bool = False
    kept: tuple[int, ...] = ()
    pages_left: int = 0
    # A page move's bytes as the mover counted them when it moved (its own
    # numa_maps read, later than the pass's): None where it cannot say.
    bytes_moved: int | None = None
    irqs_bound: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (IRQ, CPUs) re-written


@dataclass(frozen=True, slots=True)
class Outcomes:
    """Everything one decision's binds did, as supervisor.watch.apply returns it."""

    threads: Mapping[int, Outcome] = field(default_factory=dict)  # by tid
    moves: tuple[Outcome, ...] = ()  # in the decision's order
    irqs: Outcome | None = None
    joins: tuple[Outcome, ...] = ()  # cgroup joins, in the decision's order
    gone: bool = False  # the decision's pid names another process now: nothing done
    cgroup: Outcome | None = None  # the decision's CgroupRepair


@dataclass(frozen=True, slots=True)
class Failure:
    """A bind failure to count and report (new, or changed reason)."""

    target: BindTarget
    what: str  # "tid 4242 (comm)", "memory", "irqs"
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Settled:
    state: RepairState
    observation: Observation  # with the CPUs the kernel kept for re-bound threads
    remaining: tuple[Finding, ...]  # still wrong after this pass ("failed" when it failed)
    rebound: Mapping[RebindReason, tuple[ThreadBind, ...]]
    migrated: tuple[tuple[MemoryMove, int], ...]  # (move, pages not moved)
    irqs_rebound: int
    failures: tuple[Failure, ...]  # new ones only: each is counted once while it lasts
    fixed: frozenset[str]
    failed: frozenset[str]
    cgroup_repaired: bool = False  # the process's cgroup re-made / its processes put back


def note_failure(
    state: RepairState, target: BindTarget, what: str, reason: str
) -> tuple[RepairState, bool]:
    """Remember a failure of (`target`, `what` up to " ("); True when it is new."""
    fail_key = (target, what.split(" (", maxsplit=1)[0])
    if state.failures.get(fail_key) == reason:
        return state, False
    return replace(state, failures={**state.failures, fail_key: reason}), True


def settle(
    decision: Decision,
    outcomes: Outcomes,
    policy: Policy,
    now: float,
    *,
    can_migrate_other: bool = True,
) -> Settled:
    """The next state and what to record, once the decision's binds ran."""
    state = decision.state
    failures = dict(state.failures)
    placed: dict[int, str] | None = None
    bound: dict[int, tuple[int, ...]] = {}
    new_failures: list[Failure] = []
    fixed: set[str] = set()
    failed: set[str] = set()
    rebound: dict[RebindReason, list[ThreadBind]] = {}
    kept_by_tid: dict[int, tuple[int, ...]] = {}
    fights = dict(state.fights)

    def fail(target: BindTarget, what: str, error: KernelError, message: str) -> None:
        fail_key = (target, what.split(" (", maxsplit=1)[0])
        if failures.get(fail_key) != error.reason:
            failures[fail_key] = error.reason
            new_failures.append(Failure(target, what, error.reason, message))

    for b in decision.binds:
        out = outcomes.threads.get(b.tid, Outcome(gone=True))
        if out.gone:
            fixed.add(f"tid {b.tid}")  # exited (or reused): nothing left to fix
            continue
        if out.error is not None:
            failed.add(f"tid {b.tid}")
            fail("thread", f"tid {b.tid} ({b.name})", out.error, str(out.error))
            continue
        failures.pop(("thread", f"tid {b.tid}"), None)
        if placed is None:
            placed, bound = dict(state.placed), dict(state.bound)
        placed[b.tid] = b.role
        bound[b.tid] = out.kept
        fixed.add(f"tid {b.tid}")
        kept_by_tid[b.tid] = out.kept
        rebound.setdefault(b.reason, []).append(b)
        if b.reason == "thread_affinity":  # a bind we made, undone since: one more round
            t = f"tid {b.tid}"
            fights[t] = fights.get(t, Fight()).after_rebind(now, policy.check_interval_s)
    migrate_after, last_move = state.migrate_after, state.last_move
    migrated_from, stale = state.migrated_from, state.memory_stale
    migrated: list[tuple[MemoryMove, int]] = []
    for i, planned in enumerate(decision.moves):
        out = outcomes.moves[i] if i < len(outcomes.moves) else Outcome(gone=True)
        if out.gone:
            continue
        if out.error is not None:
            failed.add("memory")
            why = str(out.error)
            if out.error.reason == "denied" and not can_migrate_other:
                why += " (the supervisor lacks CAP_SYS_NICE)"
            fail("memory", "memory", out.error, why)
            continue
        failures.pop(("memory", "memory"), None)
        # The event and the rate limit count what moved, not what the pass's
        # earlier read saw remote (a worker still allocating).
        m = planned if out.bytes_moved is None else replace(planned, remote_bytes=out.bytes_moved)
        migrated.append((m, out.pages_left))
        if m.reason == "cpuset_changed":
            continue
        rate = max(policy.migrate_max_bytes_per_s, 1)
        # The next move waits as long as this one's bytes take at the rate: a
        # chunked move (one pass's share) goes on at the next pass, a whole
        # migrate_pages(2) holds the next one off longer.
        migrate_after = now + max(m.remote_bytes / rate, policy.check_interval_s)
        last_move = MoveRecord(m.from_nodes, m.to_nodes, now)
        migrated_from, stale = m.ratio, True
    irqs_rebound = 0
    cgroup_repaired = False
    if decision.irq_reason is not None:
        out = outcomes.irqs if outcomes.irqs is not None else Outcome()
        if out.error is not None:
            failed.update(f.target for f in decision.findings if f.kind == "irq_affinity")
            fail("irq", "irqs", out.error, str(out.error))
        else:
            failures.pop(("irq", "irqs"), None)
            fixed.update(f"irq {irq}" for irq, _ in out.irqs_bound)
            irqs_rebound = len(out.irqs_bound)
    if decision.cgroup is not None:
        out = outcomes.cgroup if outcomes.cgroup is not None else Outcome(gone=True)
        targets = {f.target for f in decision.findings if f.kind == "cgroup"}
        if out.error is not None:
            failed.update(targets)
            fail("cgroup", "cgroup", out.error, str(out.error))
        elif not out.gone:
            failures.pop(("cgroup", "cgroup"), None)
            fixed.update(targets)
            cgroup_repaired = True
            if decision.cgroup.reason == "cgroup":  # found undone since the last repair?
                fights["cgroup"] = fights.get("cgroup", Fight()).after_rebind(
                    now, policy.check_interval_s
                )
    remaining = tuple(
        f if f.target not in failed else replace(f, action="failed")
        for f in decision.findings
        if f.target not in fixed
        or f.kind == "conflict"  # a re-bind ends no fight: the next pass tells
    )
    observation = decision.observation
    if kept_by_tid:
        observation = replace(
            observation,
            threads=tuple(
                replace(t, cpus=kept_by_tid[t.tid]) if t.tid in kept_by_tid else t
                for t in observation.threads
            ),
        )
    unchanged = (
        placed is None
        and fights == state.fights
        and failures == state.failures
        and (migrate_after, last_move, migrated_from, stale)
        == (state.migrate_after, state.last_move, state.migrated_from, state.memory_stale)
    )
    return Settled(
        state  # the steady state: nothing bound, moved or failed anew
        if unchanged
        else replace(
            state,
            placed=state.placed if placed is None else placed,
            bound=state.bound if placed is None else bound,
            failures=failures,
            migrate_after=migrate_after,
            last_move=last_move,
            migrated_from=migrated_from,
            memory_stale=stale,
            fights=fights,
        ),
        observation,
        remaining,
        MappingProxyType({r: tuple(bs) for r, bs in rebound.items()}),
        tuple(migrated),
        irqs_rebound,
        tuple(new_failures),
        frozenset(fixed),
        frozenset(failed),
        cgroup_repaired,
    )


def drift_outcomes(
    found: Sequence[Finding], fixed: frozenset[str], failed: frozenset[str]
) -> dict[str, str]:
    """Each new finding's outcome for its event: failed, fixed, or its action."""
    return {
        f.target: "failed" if f.target in failed else "fixed" if f.target in fixed else f.action
        for f in found
    }


def moved_by_plan(
    old: Slot, new: Slot, observation: Observation, binds: Sequence[ThreadBind]
) -> int:
    """Threads a new plan moved that needed no bind of ours: each is on its role's
    new CPUs, which differ from its old ones (its cgroup's cpuset write put it there)."""
    bound = {b.tid for b in binds}
    n = 0
    for t in observation.threads:
        want = set(new.role_cpus(t.role))
        if t.tid not in bound and set(t.cpus) == want and set(old.role_cpus(t.role)) != want:
            n += 1
    return n
