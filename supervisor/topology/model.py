"""The discovered host, as frozen data (no I/O).

`read_topology` (supervisor.topology) builds a `Topology` through HostFS; the
planner and everything after it only ever see these types. Ids are the
kernel's: CPU ids, NUMA node ids, IRQ numbers, PCI addresses ("bdf",
"0000:18:00.0").
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Literal

from supervisor.topology.accelerators import AUTO, AcceleratorSetting, DeviceKind, kind_rank

Locality = Literal["numa_node", "local_cpulist", "ubcore", "config", "unknown"]
"""Where a device's NUMA node came from; `unknown` means plan by global slice."""


@dataclass(frozen=True, slots=True)
class Cpu:
    """One online logical CPU."""

    id: int
    core: int  # core_id: unique within a package (and die), not globally
    package: int
    die: int
    cluster: int
    node: int  # -1 when no NUMA node lists it
    siblings: frozenset[int]  # SMT siblings including itself (core_cpus_list)
    l3: int | None = None  # its L3 domain, named by the domain's lowest CPU; None: unknown


def _first(pair: tuple[int, int]) -> int:
    return pair[0]


@dataclass(frozen=True, slots=True)
class Node:
    """One NUMA node; `cpus` may be empty (HBM, CXL) and memory may be 0."""

    id: int
    cpus: frozenset[int]
    mem_total_bytes: int
    distances: tuple[tuple[int, int], ...]  # (other node, distance), node order

    def distance_to(self, other: int) -> int | None:
        # Rows are in node id order (parse_distance): a binary search, since
        # a full matrix walk calls this nodes² times (1,024 nodes: 1M calls).
        i = bisect.bisect_left(self.distances, other, key=_first)
        if i < len(self.distances) and self.distances[i][0] == other:
            return self.distances[i][1]
        for node, dist in self.distances:  # a row built out of order (by hand)
            if node == other:
                return dist
        return None


@dataclass(frozen=True, slots=True)
class CgroupLine:
    """One line of /proc/self/cgroup: "hierarchy-ID:controller-list:cgroup-path"."""

    hierarchy: int
    controllers: tuple[str, ...]
    path: str


@dataclass(frozen=True, slots=True)
class EngineScope:
    """Attach mode: the plan fits the engine's cgroup's cpuset (`lines`: its
    /proc/PID/cgroup, or a `cgroup` target's path; None when unknown: the
    supervisor's own set then) ∩ the operator's `engine.attach.cpus` (`cpus`)."""

    lines: tuple[CgroupLine, ...] | None
    cpus: frozenset[int] | None = None
    # `engine.attach.devices`: the accelerators (PCI addresses) the engine can reach;
    # discovery keeps only these (topology.discover). None: all of the host's.
    devices: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Allowed:
    """What the plan may use: the supervisor's own affinity ∩ its cgroup's cpuset or,
    in attach mode, the engine's cgroup's cpuset (`of_engine`; topology.cgroup)."""

    cpus: frozenset[int]
    mems: frozenset[int]
    cgroup_path: str | None  # the cpuset's cgroup, e.g. "/system.slice/x"
    cgroup_version: Literal[1, 2] | None
    # Attach mode: what it was read from (kept so that every re-read after a cpuset
    # change reads the same); `of_engine` then says it is the engine cgroup's.
    scope: EngineScope | None = None

    @property
    def of_engine(self) -> bool:
        """The engine's cgroup's cpuset, not the supervisor's: a rank's memory node
        outside its mems is then left alone rather than replaced (docs/attach.md)."""
        return self.scope is not None and self.scope.lines is not None


@dataclass(frozen=True, slots=True)
class Irq:
    """One interrupt line with the device (bdf) or name that owns it."""

    number: int
    name: str  # the actions column of /proc/interrupts ("virtio3-rx", "mlx5_comp0@pci:...")
    bdf: str | None


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator (or config-named PCI device, or a CPU node stand-in).

    `index` is the device's index within its kind as its runtime numbers
    devices: PCI bus order (the driver's enumeration), or the logical id
    where the runtime counts by that (Ascend); the number index entries of
    the visibility variables (CUDA_VISIBLE_DEVICES, ...) use. It orders all devices of the
    kind on the host: shares of a node and global slices go by it, so two
    supervisors seeing different devices of the same host never overlap.
    `ordinal` is the device's position in its kind's visibility list (CUDA's
    device ordinal, what LOCAL_RANK means), None when hidden; ranks follow it.
    """

    kind: DeviceKind
    index: int
    bdf: str | None
    numa_node: int | None  # None: unknown
    locality: Locality
    local_cpus: frozenset[int] | None = None  # from local_cpulist when narrower than all CPUs
    uuid: str | None = None  # NVIDIA "GPU-..." from the information file
    name: str | None = None  # model name, when the host says
    visible: bool = True
    irqs: tuple[int, ...] = ()
    ordinal: int | None = None  # set by visibility.apply_visibility; None: index order
    # Where `index` came from when the runtime does not number by PCI bus
    # order (supervisor.topology.logical_ids): "config logical_ids", the
    # captured tool output, or "PCI bus order" where neither was there.
    id_source: str | None = None

    @property
    def label(self) -> str:
        return f"{self.kind}{self.index}"


# Devices order by kind (the registry's order: accelerators before
# config-named PCI devices before CPU stand-ins), then index. Discovery lists
# them so; ranks follow the visibility list within a kind (rank_order).


def device_order(device: Device) -> tuple[int, int]:
    """Sort key of devices on the host: kind (accelerators.KINDS), then index (PCI bus order)."""
    return (kind_rank(device.kind), device.index)


def rank_order(device: Device) -> tuple[int, int, int]:
    """Sort key of visible devices into ranks: kind, then visibility ordinal
    (docs/contracts.md §3: rank r drives the r-th device of the list), then index; a
    device without an ordinal counts by its index (PCI bus order)."""
    ordinal = device.index if device.ordinal is None else device.ordinal
    return (kind_rank(device.kind), ordinal, device.index)


@dataclass(frozen=True, slots=True)
class Nic:
    """A network interface (InfiniBand HCA or netdev) backed by a PCI function."""

    name: str  # "mlx5_0" or "eth0"
    kind: Literal["infiniband", "net"]
    bdf: str | None
    numa_node: int | None
    irqs: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Topology:
    """Everything discovery found; ordered, deterministic, comparable."""

    cpus: tuple[Cpu, ...]  # online CPUs, by id
    present: frozenset[int]
    possible: frozenset[int]
    nodes: tuple[Node, ...]  # online nodes, by id
    allowed: Allowed
    devices: tuple[Device, ...]  # all devices, visible or not, kind then index order
    nics: tuple[Nic, ...] = ()
    irqs: tuple[Irq, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    numa_balancing: int | None = None  # kernel.numa_balancing (topology.kernel); None: none

    @property
    def online(self) -> frozenset[int]:
        return frozenset(c.id for c in self.cpus)

    def cpu(self, cpu_id: int) -> Cpu:
        for c in self.cpus:
            if c.id == cpu_id:
                return c
        raise KeyError(cpu_id)

    def node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    @property
    def visible_devices(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.visible)


@dataclass(frozen=True, slots=True)
class DiscoveryOptions:
    """What discovery is told from outside: config keys and the environment.

    `env` holds the visibility variables (CUDA_VISIBLE_DEVICES, ...) as the
    caller read them; discovery never reads os.environ itself.
    """

    accelerator: AcceleratorSetting = AUTO
    pci_devices: tuple[str, ...] = ()  # config `devices = [...]`: any vendor, by address
    cpu_ranks: int = 1  # without accelerators: at least this many `cpu` stand-in devices
    env: tuple[tuple[str, str], ...] = ()
    # config `logical_ids = [...]`: PCI addresses in the runtime's logical id
    # order, for kinds numbered so (supervisor.topology.logical_ids)
    logical_ids: tuple[str, ...] = ()
    # attach mode: the allowed set is the engine's cgroup's (trees.attach.engine_scope)
    scope: EngineScope | None = None
