"""Re-planning after a cpuset change or CPU hotplug (pure, no I/O).

The check loop reads the supervisor's allowed CPUs and nodes every cycle
(`observe.read_self_allowed`, `observe.read_online_cpus`); `normalize_allowed`
puts them in the form discovery uses, so they compare with the start-up
`Topology.allowed`. On a change the loop re-reads the topology and calls
`replan()`: the planner with the new allowed set, degrading from the
configured `on_shortage` to "merge" and then "share" when the smaller set
cannot hold the plan's minimums (a worker is never stopped for lack of CPUs).
The ranks stay those the daemon started with: `merge_topology` keeps the
start-up devices, so a cpuset that no longer touches a node does not drop
that node's CPU stand-in rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from supervisor.errors import PlanError
from supervisor.plan.keys import ProcKey
from supervisor.plan.placement import Placement, PlanSettings, Shortage, Slot
from supervisor.plan.planner import plan
from supervisor.topology.model import Topology


@dataclass(frozen=True, slots=True)
class AllowedSet:
    """The CPUs (online ones only) and memory nodes the supervisor may use."""

    cpus: frozenset[int]
    mems: frozenset[int]


@dataclass(frozen=True, slots=True)
class Replan:
    """A new plan, and how far it had to degrade."""

    placement: Placement
    topology: Topology
    shortage: Shortage | None  # None: the configured on_shortage sufficed
    degraded: tuple[str, ...] = ()  # why each rung of the ladder failed


def normalize_allowed(
    cpus: Iterable[int], mems: Iterable[int], online: Iterable[int], node_ids: Iterable[int]
) -> AllowedSet:
    """Allowed CPUs ∩ online CPUs and allowed nodes ∩ known nodes, as discovery's
    `read_allowed` computes them, so hotplug shows up as a change too."""
    return AllowedSet(frozenset(cpus) & frozenset(online), frozenset(mems) & frozenset(node_ids))


def allowed_of(topology: Topology) -> AllowedSet:
    """The allowed set a topology was planned with."""
    return AllowedSet(topology.allowed.cpus & topology.online, topology.allowed.mems)


def merge_topology(fresh: Topology, old: Topology) -> Topology:
    """`fresh` CPUs, nodes and allowed set with `old`'s devices, NICs and IRQs.

    The daemon's ranks are fixed for its lifetime (one worker per rank, its
    command and cgroup named by rank); only where they run may change.
    """
    return replace(fresh, devices=old.devices, nics=old.nics, irqs=old.irqs)


def shortage_ladder(configured: Shortage | None) -> tuple[Shortage | None, ...]:
    """The on_shortage settings to try in turn: the configured one, then merge, then share."""
    order: tuple[Shortage, ...] = ("error", "merge", "share")
    if configured is None:
        return (None, "merge", "share")
    return order[order.index(configured) :]


def replan(topology: Topology, settings: PlanSettings) -> Replan:
    """Plan on `topology`, degrading on_shortage until a plan fits.

    Raises PlanError (the last rung's) when not even sharing CPUs fits, e.g.
    no allowed CPU at all.
    """
    failures: list[str] = []
    last: PlanError | None = None
    for i, shortage in enumerate(shortage_ladder(settings.on_shortage)):
        try:
            placement = plan(topology, replace(settings, on_shortage=shortage))
        except PlanError as err:
            failures.append(f"on_shortage={shortage or 'default'}: {err}")
            last = err
            continue
        return Replan(placement, topology, shortage if i else None, tuple(failures))
    assert last is not None
    raise last


def slots_by_key(placement: Placement) -> dict[ProcKey, Slot]:
    slots: dict[ProcKey, Slot] = {}
    if placement.engine is not None:
        slots["engine"] = placement.engine
    for rank in placement.ranks:
        slots[rank.rank] = rank.slot
    return slots


def same_processes(old: Placement, new: Placement) -> bool:
    """True when both plans hold the same processes (engine and rank numbers)."""
    return slots_by_key(old).keys() == slots_by_key(new).keys()


def changed_keys(old: Placement, new: Placement) -> tuple[ProcKey, ...]:
    """The processes whose CPUs, memory nodes or roles differ between two plans."""
    before, after = slots_by_key(old), slots_by_key(new)
    return tuple(
        key
        for key, slot in after.items()
        if key not in before
        or before[key].cpus != slot.cpus
        or before[key].mems != slot.mems
        or dict(before[key].roles) != dict(slot.roles)
    )


def mems_changed(old: Placement, new: Placement, key: ProcKey) -> bool:
    before, after = slots_by_key(old), slots_by_key(new)
    return key in before and key in after and set(before[key].mems) != set(after[key].mems)
