"""docs/contracts.md §3 plan invariants as one reusable checker (no I/O).

`check_placement(topology, placement)` raises AssertionError naming the first
broken property. Planner, CLI, daemon and drift tests all call it, so a plan
is held to the same contract wherever it comes from.
"""

from __future__ import annotations

from collections.abc import Iterable

from supervisor.plan.placement import Placement, Slot
from supervisor.topology.model import Topology, rank_order


def _nearest(topology: Topology, start: int, candidates: Iterable[int]) -> int:
    def key(n: int) -> tuple[float, int]:
        if n == start:
            return (0.0, n)
        try:
            dist = topology.node(start).distance_to(n)
        except KeyError:
            dist = None
        return (float("inf") if dist is None else float(dist), n)

    return min(candidates, key=key)


def check_placement(topology: Topology, placement: Placement) -> None:
    """Assert every docs/contracts.md §3 property of `placement` on `topology`."""
    allowed = topology.allowed.cpus & topology.online
    siblings = {c.id: (c.siblings & allowed) | {c.id} for c in topology.cpus}
    cpu_node = {c.id: c.node for c in topology.cpus}
    nodes_with_cpus = {n.id for n in topology.nodes if n.cpus}
    allowed_nodes = {cpu_node[c] for c in allowed} - {-1}

    # Rank r drives the r-th device of the visibility list (its ordinal).
    visible = sorted(topology.visible_devices, key=rank_order)
    planned = [d for r in placement.ranks for d in r.all_devices]
    assert [(d.kind, d.index) for d in planned] == [(d.kind, d.index) for d in visible], (
        f"ranks drive {planned}, visible devices are {visible}"
    )
    assert [r.rank for r in placement.ranks] == list(range(len(placement.ranks)))

    slots: list[tuple[str, Slot]] = [(f"rank {r.rank}", r.slot) for r in placement.ranks]
    if placement.engine is not None:
        slots.append(("engine", placement.engine))

    for name, slot in slots:
        assert slot.cpus, f"{name}: no CPUs"
        assert list(slot.cpus) == sorted(set(slot.cpus)), f"{name}: cpus not sorted/unique"
        assert all(isinstance(c, int) for c in slot.cpus)
        assert set(slot.cpus) <= allowed, (
            f"{name}: CPUs {sorted(set(slot.cpus) - allowed)} outside the allowed cpuset"
        )
        owned = set(slot.cpus)
        # Shares by CPU only where whole cores cannot hold the roles, and said so.
        split_ok = any("SMT siblings split between ranks" in w for w in placement.warnings)
        for cpu in slot.cpus:
            assert split_ok or siblings[cpu] <= owned, f"{name}: SMT core of CPU {cpu} split"
        seen: set[int] = set()
        assert "main" in slot.roles, f"{name}: no main role"
        for role, cpus in slot.roles.items():
            assert cpus, f"{name}: role {role} empty"
            assert list(cpus) == sorted(set(cpus)), f"{name}: role {role} not sorted/unique"
            assert not seen & set(cpus), f"{name}: role {role} overlaps another role"
            seen |= set(cpus)
            # Roles by CPU only where whole-core roles cannot fit, and said so.
            by_cpu = split_ok or any(
                w.startswith(f"{name} (") and "roles by CPU" in w for w in placement.warnings
            )
            for cpu in cpus:
                assert by_cpu or siblings[cpu] <= set(cpus), (
                    f"{name}: role {role} splits core of {cpu}"
                )
        assert seen == owned, f"{name}: roles do not cover cpus"
        assert slot.mems, f"{name}: no mems"
        assert list(slot.mems) == sorted(set(slot.mems))
        for node in slot.mems:
            assert node in nodes_with_cpus, f"{name}: mems include CPU-less node {node}"
        if topology.allowed.mems:
            assert set(slot.mems) <= topology.allowed.mems, f"{name}: mems outside allowed"

    overlap = False
    for i, (name_a, a) in enumerate(slots):
        for name_b, b in slots[i + 1 :]:
            common = set(a.cpus) & set(b.cpus)
            if common:
                overlap = True
                assert placement.shared, f"{name_a} and {name_b} share CPUs {sorted(common)}"
    assert overlap == placement.shared, "shared flag does not match the plan"
    if placement.shared:
        assert any("shared" in w for w in placement.warnings), "shared plan without a warning"

    for r in placement.ranks:
        if r.strategy != "numa-affine":
            continue
        expected_cpu_nodes: set[int] = set()
        for d in r.all_devices:
            assert d.numa_node is not None, f"rank {r.rank}: numa-affine without a node"
            if d.numa_node in allowed_nodes:
                expected_cpu_nodes.add(d.numa_node)
            else:
                expected_cpu_nodes.add(_nearest(topology, d.numa_node, allowed_nodes))
            if d.numa_node in nodes_with_cpus and (
                not topology.allowed.mems or d.numa_node in topology.allowed.mems
            ):
                assert d.numa_node in r.slot.mems, (
                    f"rank {r.rank}: mems {r.slot.mems} miss its device node {d.numa_node}"
                )
        got = {cpu_node[c] for c in r.slot.cpus}
        assert got <= expected_cpu_nodes, (
            f"rank {r.rank}: CPUs on nodes {sorted(got)}, expected {sorted(expected_cpu_nodes)}"
        )

    engine, node = placement.engine, placement.engine_node
    if engine is not None and placement.ranks and node is None:
        assert engine.mems == placement.ranks[0].slot.mems, "engine mems != rank 0's"
    elif engine is not None and node is not None:
        # The engine apart from the ranks: on one node that no device plans
        # its CPUs on, with that node's memory where the cpuset allows it.
        assert {cpu_node[c] for c in engine.cpus} == {node}, f"engine not on node {node}"
        homes = {
            _nearest(topology, d.numa_node, allowed_nodes)
            for d in topology.devices
            if d.numa_node is not None
        }
        assert node not in homes, f"engine on node {node}, home of a device"
        mems_ok = not topology.allowed.mems or node in topology.allowed.mems
        assert engine.mems == ((node,) if mems_ok else placement.ranks[0].slot.mems)
    else:
        assert node is None, "engine_node without an engine"

    # The IRQ plan: each IRQ on one rank at most, delivered to that rank's irq CPUs.
    owners: dict[int, int] = {}
    for r in placement.ranks:
        for irq in r.irqs:
            assert irq.irq not in owners, (
                f"irq {irq.irq} planned for ranks {owners[irq.irq]} and {r.rank}"
            )
            owners[irq.irq] = r.rank
            assert irq.cpus == tuple(sorted(set(r.slot.role_cpus("irq")))), (
                f"rank {r.rank}: irq {irq.irq} on CPUs {irq.cpus}, its irq role is "
                f"{r.slot.role_cpus('irq')}"
            )
        assert [i.irq for i in r.irqs] == sorted(i.irq for i in r.irqs)
