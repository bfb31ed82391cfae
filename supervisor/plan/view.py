"""The planner's view of the host and its draft (pure, no I/O; planner-internal).

`host_view` indexes the topology once: allowed whole cores (SMT siblings
joined), their nodes, SLIT distances. `Draft` is the mutable scratch of one
`plan()` call that the pool, engine and slot steps fill in; it never escapes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from math import inf
from typing import Literal

from supervisor.plan.placement import PlanSettings, Shortage
from supervisor.topology.model import Device, Node, Topology

Core = tuple[int, ...]
"""The allowed online SMT siblings of one physical core, sorted (one CPU without SMT)."""

DeviceStrategy = Literal["numa-affine", "global-slice", "topo-affinity"]
DeviceKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class HostView:
    """The part of the topology the planner uses, indexed once."""

    cores: tuple[Core, ...]  # allowed cores, by first CPU
    core_node: Mapping[Core, int]  # -1 when no NUMA node lists the core
    node_cores: Mapping[int, tuple[Core, ...]]  # nodes with allowed cores only
    nodes: Mapping[int, Node]
    cpu_node: Mapping[int, int]
    nodes_with_cpus: frozenset[int]  # nodes with online CPUs at all (not HBM/CXL)
    allowed_mems: frozenset[int]  # empty: unrestricted
    cpu_l3: Mapping[int, int] = field(default_factory=dict)  # CPU -> L3 domain, where known
    # Attach mode: `allowed_mems` is the engine's cgroup's cpuset.mems, which the kernel
    # does not enforce on migrate_pages(2) by a CAP_SYS_NICE caller: a node outside is
    # dropped, never replaced by a nearer one (plan.planner._device_mems).
    mems_of_engine: bool = False


@dataclass(slots=True)
class Draft:
    """Mutable scratch of one plan() call; never escapes it."""

    settings: PlanSettings
    mode: Shortage
    shares: dict[DeviceKey, list[Core]] = field(default_factory=dict)
    # (place, context): ("node 1", "allowed CPUs on node 1: 8 for 2 devices")
    where: dict[DeviceKey, tuple[str, str]] = field(default_factory=dict)
    engine: list[Core] | None = None
    engine_roles: dict[str, list[Core]] | None = None
    engine_node: int | None = None  # set when the engine sits on a device-free node
    warnings: list[str] = field(default_factory=list)


def host_view(topology: Topology) -> HostView:
    """The allowed online CPUs as whole cores, with their nodes (pure)."""
    allowed = topology.allowed.cpus & topology.online
    by_id = {c.id: c for c in topology.cpus}
    # Union-find over sibling lists: a core is whatever its siblings connect,
    # so one inconsistent thread_siblings_list cannot make two cores overlap.
    parent = {c: c for c in allowed}

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for cpu_id in sorted(allowed):
        for sibling in by_id[cpu_id].siblings:
            if sibling in allowed:
                a, b = root(cpu_id), root(sibling)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for cpu_id in sorted(allowed):
        groups.setdefault(root(cpu_id), []).append(cpu_id)
    cores = tuple(sorted(tuple(g) for g in groups.values()))
    cpu_node = {c.id: c.node for c in topology.cpus}
    core_node = {core: cpu_node[core[0]] for core in cores}
    node_cores: dict[int, list[Core]] = {}
    for core in cores:
        if core_node[core] >= 0:
            node_cores.setdefault(core_node[core], []).append(core)
    nodes = {n.id: n for n in topology.nodes}
    with_cpus = frozenset(n.id for n in topology.nodes if n.cpus) | {
        n for n in cpu_node.values() if n >= 0
    }
    return HostView(
        cores=cores,
        core_node=core_node,
        node_cores={n: tuple(cs) for n, cs in node_cores.items()},
        nodes=nodes,
        cpu_node=cpu_node,
        nodes_with_cpus=with_cpus,
        allowed_mems=topology.allowed.mems,
        mems_of_engine=topology.allowed.of_engine,
        cpu_l3={c.id: c.l3 for c in topology.cpus if c.l3 is not None},
    )


def device_key(device: Device) -> DeviceKey:
    return (device.kind, device.index)


def node_distance(view: HostView, a: int, b: int) -> float:
    if a == b:
        return 0
    node = view.nodes.get(a)
    dist = None if node is None else node.distance_to(b)
    return inf if dist is None else dist


def nearest_node(view: HostView, start: int, candidates: Iterable[int]) -> int | None:
    """The candidate closest to `start` by SLIT distance; ties (and unknown
    distances) go to the lowest node id, so the choice is deterministic."""
    ordered = sorted(candidates, key=lambda n: (node_distance(view, start, n), n))
    return ordered[0] if ordered else None


def nearest_cpu_node(view: HostView, node_id: int | None) -> int:
    # Callers only pass devices with a known node, on a view with node cores.
    assert node_id is not None
    if node_id in view.node_cores:
        return node_id
    nearest = nearest_node(view, node_id, view.node_cores)
    assert nearest is not None
    return nearest


def cpus_of(cores: Iterable[Core]) -> tuple[int, ...]:
    return tuple(sorted(cpu for core in cores for cpu in core))


def count_cpus(cores: Iterable[Core]) -> str:
    n = sum(len(c) for c in cores)
    return f"{n} CPU" if n == 1 else f"{n} CPUs"
