"""An adopted worker's binds as a decision (pure, no I/O).

`decide_adoption` turns what was read of an engine-spawned process and its
descendants (`Adoptee`: pid, start time, threads with theirs) into the
`decide.Decision` that the one `watch.apply.Applier` carries out, identity
checks included: join the rank's cgroups, every thread onto the rank's CPUs,
the worker's pages onto the rank's nodes. `adoption_result` folds the
Applier's `Outcomes` into what the adopting runner records. `decide_detach`
is attach mode's stop (supervisor.trees.attach): every thread back to the
CPUs its process had when found, nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from supervisor.plan.keys import ProcKey
from supervisor.plan.placement import Slot
from supervisor.procfs.identity import ProcessId, ThreadId
from supervisor.state import BindTarget, Observation
from supervisor.watch.decide import Decision, MemoryMove, ThreadBind
from supervisor.watch.settle import Outcomes


@dataclass(frozen=True, slots=True)
class Adoptee:
    """One process to adopt (the worker, or one of its descendants) as read."""

    id: ProcessId
    threads: tuple[ThreadId, ...]

    @property
    def pid(self) -> int:
        return self.id.pid


@dataclass(frozen=True, slots=True)
class AdoptResult:
    """What an adoption did: for the adopt event and the bind failures."""

    gone: bool  # the worker was no longer the process offered: nothing was done
    cpus: tuple[int, ...]  # every thread's affinity read back (union)
    errors: tuple[tuple[BindTarget, str, str], ...]  # (target, reason, message)
    moved: int  # processes now in the rank's cgroups (all, without cgroups)
    pages_left: int = 0


def decide_adoption(
    key: ProcKey,
    adoptees: Sequence[Adoptee],
    slot: Slot,
    node_ids: Iterable[int],
    *,
    join: bool,
) -> Decision:
    """The worker (`adoptees[0]`) and its descendants into `slot`: with `join`, each
    process into the rank's cgroups first (its cpuset then bounds whatever the
    process does next; writing a pid to cgroup.procs moves all its threads,
    cgroups(7)); every thread bound to the slot's CPUs, whatever its role: the
    check loop puts each role in place at its next pass; the worker's pages on
    other nodes moved to the slot's."""
    worker = adoptees[0]
    cpus = tuple(sorted(slot.cpus))
    # "thread_role": a thread put in its place for the first time, not drift.
    binds = tuple(
        ThreadBind(t.tid, "", "", cpus, "thread_role", t, a.pid)
        for a in adoptees
        for t in a.threads
    )
    mems = tuple(sorted(slot.mems))
    remote = tuple(sorted(set(node_ids) - set(mems)))
    moves = (
        (MemoryMove(worker.pid, remote, mems, 0, 0.0, "memory_locality"),)
        if remote and mems
        else ()
    )
    joins = tuple(a.id for a in adoptees) if join else ()
    return Decision(key, worker.pid, Observation(), (), (), binds, moves, joins=joins)


def decide_detach(
    key: ProcKey, adoptees: Sequence[Adoptee], cpus_of: Mapping[int, Iterable[int]]
) -> Decision:
    """Every thread of `adoptees` (the first: the decision's process) back to its
    process's CPUs in `cpus_of` (by pid; a process not in it is left alone): no
    page moves, no cgroup joins."""
    binds = tuple(
        ThreadBind(t.tid, "", "", tuple(sorted(cpus_of[a.pid])), "thread_role", t, a.pid)
        for a in adoptees
        if a.pid in cpus_of
        for t in a.threads
    )
    return Decision(key, adoptees[0].pid, Observation(), (), (), binds, ())


def adoption_result(d: Decision, out: Outcomes, processes: int) -> AdoptResult:
    """What the Applier did with an adoption's decision of `processes` processes (pure)."""
    if out.gone:
        return AdoptResult(True, (), (), 0)
    errors: list[tuple[BindTarget, str, str]] = []
    moved = processes - sum(1 for o in out.joins if o.error is not None or o.gone)
    if out.joins and out.joins[0].error is not None:
        err = out.joins[0].error
        errors.append(("cgroup", err.reason, str(err)))
    seen: set[int] = set()
    for tid, o in out.threads.items():
        seen.update(o.kept)
        if o.error is not None:
            errors.append(("thread", o.error.reason, f"tid {tid}: {o.error}"))
    left = 0
    for m in out.moves:
        left += m.pages_left
        if m.error is not None:
            errors.append(("memory", m.error.reason, str(m.error)))
    return AdoptResult(False, tuple(sorted(seen)), tuple(errors), moved, left)
