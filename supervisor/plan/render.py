"""Text rendering of a plan for people: the table `plan` prints and the daemon logs (no I/O).

CPU and node sets are kernel cpulists ("0-3,8"), so what a person reads here
is what `taskset -c` and `numactl` take.
"""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.cpulist import format_cpulist
from supervisor.plan.placement import Placement, Slot
from supervisor.topology.model import Topology


def _role_names(placement: Placement) -> list[str]:
    """Role columns: irq, main, then the others in the order first seen."""
    slots: list[Slot] = [r.slot for r in placement.ranks]
    if placement.engine is not None:
        slots.append(placement.engine)
    seen: dict[str, None] = {}
    for slot in slots:
        for role in slot.roles:
            seen.setdefault(role, None)
    head = [r for r in ("irq", "main") if r in seen]
    return head + [r for r in seen if r not in head]


def _cpu_nodes(topology: Topology | None, cpus: Sequence[int]) -> str:
    if topology is None:
        return ""
    node_of = {c.id: c.node for c in topology.cpus}
    return format_cpulist(node_of[c] for c in cpus if node_of.get(c, -1) >= 0) or "-"


def render_plan_table(placement: Placement, topology: Topology | None = None) -> str:
    """A table with one row per rank plus the engine, then the warnings.

    Columns: rank, device, bdf, node (the device's NUMA node), cpu-nodes (the
    nodes of the planned CPUs; with a topology), cpus, mems, one column per
    role, strategy, l3 (each rank's L3 domains by lowest CPU) where known, and
    irqs (the IRQ numbers the rank's irq CPUs take) where the plan binds any.
    """
    roles = _role_names(placement)
    l3 = any(r.l3_domains for r in placement.ranks)
    irqs = placement.has_irqs
    header = ["rank", "device", "bdf", "node"]
    if topology is not None:
        header.append("cpu-nodes")
    header += ["cpus", "mems", *roles, "strategy", *(["l3"] if l3 else [])]
    header += ["irqs"] if irqs else []
    rows: list[list[str]] = []
    for r in placement.ranks:
        devices = r.all_devices
        row = [
            str(r.rank),
            "+".join(f"{d.kind}{d.index}" for d in devices),
            ",".join(d.bus_id or "-" for d in devices),
            ",".join("?" if d.numa_node is None else str(d.numa_node) for d in devices),
        ]
        if topology is not None:
            row.append(_cpu_nodes(topology, r.slot.cpus))
        row += [format_cpulist(r.slot.cpus), format_cpulist(r.slot.mems)]
        row += [format_cpulist(r.slot.roles.get(role, ())) or "-" for role in roles]
        row.append(r.strategy)
        if l3:
            row.append(",".join(str(n) for n in r.l3_domains) or "-")
        if irqs:
            row.append(format_cpulist(a.irq for a in r.irqs) or "-")
        rows.append(row)
    if placement.engine is not None:
        e = placement.engine
        row = ["engine", "-", "-", "-"]
        if topology is not None:
            row.append(_cpu_nodes(topology, e.cpus))
        row += [format_cpulist(e.cpus), format_cpulist(e.mems)]
        row += [format_cpulist(e.roles.get(role, ())) or "-" for role in roles]
        row += ["-"] * (1 + l3 + irqs)
        rows.append(row)
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in [header, *rows]
    ]
    summary = f"strategy: {placement.strategy}"
    if placement.shared:
        summary += " (shared: some CPUs serve more than one process)"
    lines.insert(0, summary)
    lines += [f"warning: {w}" for w in placement.warnings]
    return "\n".join(lines)
