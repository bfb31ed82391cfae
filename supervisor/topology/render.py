"""Rendering a Topology for the `topology` command: text and a JSON-able document (pure).

The text reads like `numactl -H` (nodes, CPUs, memory, distances) followed by
an `nvidia-smi topo -m`-style device table; the document holds the same facts
with sorted lists, so equal topologies give byte-equal JSON.
"""

from __future__ import annotations

from typing import Any

from supervisor.cpulist import format_cpulist
from supervisor.topology.model import Topology

MIB = 1 << 20


def _cpus_of_devices_node(topo: Topology, node: int | None) -> frozenset[int]:
    if node is None:
        return frozenset()
    return topo.node(node).cpus


def render_topology_text(topo: Topology) -> str:
    lines: list[str] = []
    packages = sorted({c.package for c in topo.cpus})
    smt = max((len(c.siblings) for c in topo.cpus), default=1)
    lines.append(
        f"cpus: {len(topo.cpus)} online ({format_cpulist(topo.online)}), "
        f"present {format_cpulist(topo.present)}, possible {format_cpulist(topo.possible)}; "
        f"{len(packages)} package(s), {smt} thread(s) per core"
    )
    lines.append(f"available: {len(topo.nodes)} nodes ({format_cpulist(n.id for n in topo.nodes)})")
    for node in topo.nodes:
        lines.append(f"node {node.id} cpus: {format_cpulist(node.cpus) or '(none)'}")
        lines.append(f"node {node.id} size: {node.mem_total_bytes // MIB} MB")
    lines.append("node distances:")
    ids = [n.id for n in topo.nodes]
    lines.append("node " + "".join(f"{i:>4}" for i in ids))
    for node in topo.nodes:
        # One dict per row, not a lookup per cell: the matrix is nodes² cells.
        row_of = dict(node.distances)
        row = "".join([str(row_of.get(i, "-")).rjust(4) for i in ids])
        lines.append(f"{node.id:>3}: {row}")
    a = topo.allowed
    cg = "none" if a.cgroup_version is None else f"v{a.cgroup_version} {a.cgroup_path}"
    lines.append(
        f"allowed: cpus {format_cpulist(a.cpus)} mems {format_cpulist(a.mems)} (cgroup {cg})"
    )
    balancing = "unknown" if topo.numa_balancing is None else str(topo.numa_balancing)
    lines.append(f"kernel.numa_balancing: {balancing}")
    lines.append("")
    lines.append(
        f"{'device':<10} {'bdf':<14} {'node':>4}  {'locality':<13} {'visible':<7} {'irqs':>4}"
        "  local cpus  irq numbers"
    )
    for d in topo.devices:
        where = "-" if d.numa_node is None else str(d.numa_node)
        local = (
            d.local_cpus if d.local_cpus is not None else _cpus_of_devices_node(topo, d.numa_node)
        )
        extra = f"  {d.name}" if d.name else ""
        lines.append(
            f"{d.label:<10} {d.bdf or '-':<14} {where:>4}  {d.locality:<13} "
            f"{'yes' if d.visible else 'no':<7} {len(d.irqs):>4}  "
            f"{format_cpulist(local) or '-'}  {format_cpulist(d.irqs) or '-'}{extra}"
        )
    # The runtime's numbering: the device label's number is the logical id.
    for source in sorted({f"{d.kind}: {d.id_source}" for d in topo.devices if d.id_source}):
        kind, _, where = source.partition(": ")
        if where == "PCI bus order":
            lines.append(
                f"{kind} device numbers: PCI bus order (the runtime's logical ids unknown)"
            )
        else:
            lines.append(f"{kind} device numbers are the runtime's logical ids, from {where}")
    if topo.nics:
        lines.append("")
        lines.append(f"{'nic':<16} {'kind':<10} {'bdf':<14} {'node':>4} {'irqs':>5}")
        for n in topo.nics:
            where = "-" if n.numa_node is None else str(n.numa_node)
            lines.append(
                f"{n.name:<16} {n.kind:<10} {n.bdf or '-':<14} {where:>4} {len(n.irqs):>5}"
            )
    owned = sum(1 for i in topo.irqs if i.bdf)
    lines.append("")
    lines.append(f"irqs: {len(topo.irqs)} ({owned} owned by a PCI function)")
    for w in topo.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines) + "\n"


def topology_to_doc(topo: Topology) -> dict[str, Any]:
    """JSON-able, deterministic: every set becomes a sorted list."""
    # Node ids as JSON keys, made once: the distance rows hold nodes² of them.
    key = {n.id: str(n.id) for n in topo.nodes}
    return {
        "version": 1,
        "cpus": [
            {
                "id": c.id,
                "core": c.core,
                "package": c.package,
                "die": c.die,
                "cluster": c.cluster,
                "node": c.node,
                "siblings": sorted(c.siblings),
            }
            | ({} if c.l3 is None else {"l3": c.l3})
            for c in topo.cpus
        ],
        "online": sorted(topo.online),
        "present": sorted(topo.present),
        "possible": sorted(topo.possible),
        "nodes": [
            {
                "id": n.id,
                "cpus": sorted(n.cpus),
                "mem_total_bytes": n.mem_total_bytes,
                "distances": {key.get(other) or str(other): d for other, d in n.distances},
            }
            for n in topo.nodes
        ],
        "allowed": {
            "cpus": sorted(topo.allowed.cpus),
            "mems": sorted(topo.allowed.mems),
            "cgroup_path": topo.allowed.cgroup_path,
            "cgroup_version": topo.allowed.cgroup_version,
        },
        "numa_balancing": topo.numa_balancing,
        "devices": [
            {
                "kind": d.kind,
                "index": d.index,
                "bus_id": d.bdf,
                "numa_node": d.numa_node,
                "locality": d.locality,
                "local_cpus": None if d.local_cpus is None else sorted(d.local_cpus),
                "uuid": d.uuid,
                "name": d.name,
                "visible": d.visible,
                "irqs": list(d.irqs),
            }
            | ({"id_source": d.id_source} if d.id_source else {})
            for d in topo.devices
        ],
        "nics": [
            {
                "name": n.name,
                "kind": n.kind,
                "bus_id": n.bdf,
                "numa_node": n.numa_node,
                "irqs": list(n.irqs),
            }
            for n in topo.nics
        ],
        "irqs": [{"irq": i.number, "name": i.name, "bus_id": i.bdf} for i in topo.irqs],
        "warnings": list(topo.warnings),
    }
