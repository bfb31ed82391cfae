"""Topology objects built directly in memory, for planner tests (no files).

`build_topology` makes a host from a few numbers; `topologies()` is a
hypothesis strategy over odd hosts (CPU-less nodes, SMT numbered both ways,
cpusets with holes, devices of unknown locality, hidden devices).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Literal

from hypothesis import strategies as st

from supervisor.topology.accelerators import DeviceKind
from supervisor.topology.model import Allowed, Cpu, Device, Node, Topology

GIB = 1 << 30


def dev(
    index: int,
    node: int | None,
    *,
    kind: DeviceKind = "nvidia",
    visible: bool = True,
    bdf: str | None = None,
    ordinal: int | None = None,
) -> Device:
    """A device on `node` (None: unknown locality, as numa_node = -1); `ordinal`
    is its place in the visibility list (None: by index, no list)."""
    return Device(
        kind=kind,
        index=index,
        bdf=bdf if bdf is not None else (None if kind == "cpu" else f"0000:{index + 16:02x}:00.0"),
        numa_node=node,
        locality="unknown" if node is None else "numa_node",
        visible=visible,
        ordinal=ordinal if visible else None,
    )


def build_topology(
    node_cores: Sequence[int],
    *,
    threads_per_core: int = 1,
    smt: Literal["intel", "adjacent"] = "intel",
    devices: Sequence[Device] = (),
    allowed_cpus: Iterable[int] | None = None,
    allowed_mems: Iterable[int] | None = None,
    distances: Sequence[Sequence[int]] | None = None,
) -> Topology:
    """A host with `node_cores[n]` physical cores on node n (0: a CPU-less node).

    SMT "intel" numbers all first threads, then all second threads (N and
    N + cores); "adjacent" numbers a core's threads next to each other.
    """
    total_cores = sum(node_cores)
    core_cpus: list[list[int]] = []
    core_node: list[int] = []
    for node_id, count in enumerate(node_cores):
        for _ in range(count):
            k = len(core_cpus)
            if smt == "intel":
                ids = [k + t * total_cores for t in range(threads_per_core)]
            else:
                ids = [k * threads_per_core + t for t in range(threads_per_core)]
            core_cpus.append(ids)
            core_node.append(node_id)
    cpus: list[Cpu] = []
    for k, siblings in enumerate(core_cpus):
        for cpu_id in siblings:
            cpus.append(
                Cpu(
                    id=cpu_id,
                    core=k,
                    package=0,
                    die=0,
                    cluster=k,
                    node=core_node[k],
                    siblings=frozenset(siblings),
                )
            )
    cpus.sort(key=lambda c: c.id)
    n = len(node_cores)
    if distances is None:
        distances = [
            [
                10 if a == b else (30 if 0 in (node_cores[a], node_cores[b]) else 20)
                for b in range(n)
            ]
            for a in range(n)
        ]
    nodes = tuple(
        Node(
            id=node_id,
            cpus=frozenset(c.id for c in cpus if c.node == node_id),
            mem_total_bytes=64 * GIB,
            distances=tuple((b, distances[node_id][b]) for b in range(n)),
        )
        for node_id in range(n)
    )
    online = frozenset(c.id for c in cpus)
    allowed = Allowed(
        cpus=online if allowed_cpus is None else frozenset(allowed_cpus) & online,
        mems=frozenset(range(n)) if allowed_mems is None else frozenset(allowed_mems),
        cgroup_path=None,
        cgroup_version=None,
    )
    return Topology(
        cpus=tuple(cpus),
        present=online,
        possible=online,
        nodes=nodes,
        allowed=allowed,
        devices=tuple(sorted(devices, key=lambda d: (d.kind, d.index))),
    )


@st.composite
def topologies(draw: st.DrawFn, kind: DeviceKind | None = None) -> Topology:
    """Odd but possible hosts: 1-4 nodes (CPU-less ones too), SMT 1/2 either
    numbering, cpusets with holes, devices hidden or of unknown locality, and
    a visibility list in any order (or none)."""
    n_nodes = draw(st.integers(1, 4))
    node_cores = draw(st.lists(st.integers(0, 12), min_size=n_nodes, max_size=n_nodes))
    if sum(node_cores) == 0:
        node_cores[0] = draw(st.integers(1, 6))
    tpc = draw(st.sampled_from([1, 2]))
    smt = draw(st.sampled_from(["intel", "adjacent"]))
    dist = [[10] * n_nodes for _ in range(n_nodes)]
    for a in range(n_nodes):
        for b in range(a + 1, n_nodes):
            dist[a][b] = dist[b][a] = draw(st.integers(11, 40))
    n_cpus = sum(node_cores) * tpc
    if draw(st.booleans()):
        allowed: set[int] | None = None
    else:
        allowed = set(draw(st.sets(st.integers(0, n_cpus - 1), min_size=1)))
    mems = None
    if draw(st.integers(0, 4)) == 0:
        mems = set(draw(st.sets(st.integers(0, n_nodes - 1), min_size=1)))
    dev_kind: DeviceKind = kind if kind is not None else draw(st.sampled_from(["nvidia", "cpu"]))
    n_dev = draw(st.integers(1, 8))
    devices = []
    for i in range(n_dev):
        node = draw(st.one_of(st.none(), st.integers(0, n_nodes - 1)))
        if dev_kind == "cpu" and node is None:
            node = 0
        devices.append(dev(i, node, kind=dev_kind, visible=draw(st.booleans())))
    if not any(d.visible for d in devices):
        first = devices[0]
        devices[0] = dev(first.index, first.numa_node, kind=first.kind)
    if draw(st.booleans()):
        # A visibility list naming the visible devices in any order.
        shown = [i for i, d in enumerate(devices) if d.visible]
        for ordinal, i in enumerate(draw(st.permutations(shown))):
            devices[i] = replace(devices[i], ordinal=ordinal)
    return build_topology(
        node_cores,
        threads_per_core=tpc,
        smt=smt,  # type: ignore[arg-type]
        devices=devices,
        allowed_cpus=allowed,
        allowed_mems=mems,
        distances=dist,
    )
