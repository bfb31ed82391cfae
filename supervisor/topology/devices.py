"""Accelerators and stand-ins: each registry kind, config-named PCI, CPU nodes (reads via HostFS).

No accelerator library is loaded: a kind (supervisor.topology.accelerators)
is found by its driver's procfs, by PCI ids, classes and driver, or by its
device nodes, its NUMA nodes folded from a sysfs class where it has one.
Devices come back with `visible=True`; `visibility.apply_visibility` narrows them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from supervisor.errors import TopologyError
from supervisor.hostfs import HostFS
from supervisor.topology.accelerators import CPU, PCI, AcceleratorKind, DeviceKind, DeviceNode
from supervisor.topology.cpus import parse_int_text
from supervisor.topology.logical_ids import numbered, read_numbering
from supervisor.topology.model import Device, Node
from supervisor.topology.pci import (
    BDF_RE,
    PCI_DIR,
    PciId,
    natural_key,
    read_pci_function,
    read_pci_id,
    resolve_locality,
)


@dataclass(frozen=True, slots=True)
class NvidiaInfo:
    """The fields we use from the NVIDIA driver's per-GPU information file."""

    model: str | None
    uuid: str | None
    bus_location: str | None


def parse_nvidia_information(text: str) -> NvidiaInfo:
    """ "Model: \\t\\t NVIDIA H100 ...", "GPU UUID: \\t GPU-...", "Bus Location: \\t 0000:..."."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            values[key.strip()] = value.strip()
    bus = values.get("Bus Location")
    return NvidiaInfo(
        model=values.get("Model") or None,
        uuid=values.get("GPU UUID") or None,
        bus_location=bus.lower() if bus else None,
    )


def _node_numbers(fs: HostFS, node: DeviceNode) -> list[int]:
    """N of every <dir>/<prefix>N (listing the directory, so snapshots carry the names)."""
    numbers = (node.number_of(name) for name in fs.listdir(node.dir))
    return sorted(n for n in numbers if n is not None)


def _pci_device(
    fs: HostFS,
    kind: DeviceKind,
    index: int,
    pid: PciId,
    nodes: tuple[Node, ...],
    *,
    uuid: str | None = None,
    name: str | None = None,
) -> tuple[Device, str | None]:
    fn = read_pci_function(fs, pid)
    where = resolve_locality(f"{kind}{index} {pid.bdf}", fn.numa_node, fn.local_cpus, nodes)
    device = Device(
        kind=kind,
        index=index,
        bdf=pid.bdf,
        numa_node=where.numa_node,
        locality=where.locality,
        local_cpus=where.local_cpus,
        uuid=uuid,
        name=name,
        irqs=fn.msi_irqs,
    )
    return device, where.warning


Found = list[tuple[Device, str | None]]  # each device with the warning it came with


def _from_driver_dir(fs: HostFS, kind: AcceleratorKind, nodes: tuple[Node, ...]) -> Found:
    """Devices of the driver's procfs, indexed in PCI bus order.

    Index = position in sorted bus id order: the order of the driver's minor
    numbers and of CUDA with CUDA_DEVICE_ORDER=PCI_BUS_ID, which deployments
    that use indices in the visibility variable set. (CUDA's own default,
    FASTEST_FIRST, only differs on hosts mixing GPU models.)
    """
    assert kind.driver_dir is not None
    found: Found = []
    entries = [e for e in fs.listdir(kind.driver_dir) if BDF_RE.fullmatch(e)]
    for index, entry in enumerate(sorted(e.lower() for e in entries)):
        rel = f"{kind.driver_dir}/{entry}/information"
        info = parse_nvidia_information(fs.read_required(rel, "NVIDIA GPU information"))
        pid = read_pci_id(fs, entry)
        if pid is None:
            device = Device(
                kind.name, index, entry, None, "unknown", uuid=info.uuid, name=info.model
            )
            found.append(
                (device, f"{device.label} {entry}: no {PCI_DIR}/{entry}: NUMA node unknown")
            )
            continue
        found.append(_pci_device(fs, kind.name, index, pid, nodes, uuid=info.uuid, name=info.model))
    return found


def _from_pci(
    fs: HostFS, kind: AcceleratorKind, scan: tuple[PciId, ...], nodes: tuple[Node, ...]
) -> tuple[Found, str | None]:
    """Devices of the PCI scan by the kind's vendor, class and driver, in PCI bus
    order (the order the vendors' runtimes enumerate, e.g. ROCm's KFD topology);
    none, with a warning, when the node the kind needs is missing."""
    assert kind.pci is not None
    candidates = [p for p in scan if kind.is_device(p.vendor, p.class_code)]
    wanted_driver = kind.pci.driver
    pci = [p for p in candidates if wanted_driver is None or _driver(fs, p.bdf) == wanted_driver]
    if pci and kind.needs_node is not None:
        where, _, name = kind.needs_node.rpartition("/")
        if name not in fs.listdir(where):
            compute = wanted_driver or kind.name
            return [], (
                f"{kind.name} devices found but no {kind.needs_node}: "
                f"{compute} compute not available, ignoring them"
            )
    return [_pci_device(fs, kind.name, index, pid, nodes) for index, pid in enumerate(pci)], None


def _from_nodes(fs: HostFS, kind: AcceleratorKind, *, warn: bool) -> Found:
    """Devices by their device nodes alone: bus id and NUMA node unknown."""
    assert kind.node_fallback is not None
    node = kind.node_fallback
    found: Found = []
    for index, number in enumerate(_node_numbers(fs, node)):
        device = Device(kind.name, index, None, None, "unknown")
        source = kind.driver_dir or "PCI function"
        warning = (
            f"{device.label}: only {node.dir}/{node.prefix}{number} found (no {source}): "
            "bus id and NUMA node unknown, planning it by global slice"
        )
        found.append((device, warning if warn else None))
    return found


def read_kind(
    fs: HostFS,
    kind: AcceleratorKind,
    scan: tuple[PciId, ...],
    nodes: tuple[Node, ...],
    logical_ids: tuple[str, ...] = (),
) -> tuple[tuple[Device, ...], tuple[str, ...]]:
    """The devices of one registry kind on the host, with warnings.

    By the driver's procfs, else the PCI scan (`scan`), else the kind's device
    nodes (the driver procfs or PCI functions hidden, e.g. in some containers);
    numbered as the kind's runtime numbers them (`logical_ids`: the config's
    override); NUMA nodes from the kind's sysfs class where it has one.
    """
    found: Found = []
    id_warnings: tuple[str, ...] = ()
    if kind.driver_dir is not None:
        found = _from_driver_dir(fs, kind, nodes)
    elif kind.pci is not None:
        found, refusal = _from_pci(fs, kind, scan, nodes)
        if refusal is not None:
            return (), (refusal,)
        if found and kind.logical_ids is not None:
            found, id_warnings, source = numbered(
                found, kind, read_numbering(fs, kind, logical_ids)
            )
            found = [(replace(d, id_source=source), w) for d, w in found]
    if not found and kind.node_fallback is not None:
        found = _from_nodes(fs, kind, warn=kind.numa_class is None)
    if kind.numa_class is not None and found:
        devices, warnings = _fold_class_nodes(fs, kind.numa_class, found, nodes)
        return devices, id_warnings + warnings
    return tuple(d for d, _ in found), id_warnings + tuple(w for _, w in found if w)


def _driver(fs: HostFS, bdf: str) -> str | None:
    link = fs.readlink(f"{PCI_DIR}/{bdf}/driver")
    return None if link is None else link.rstrip("/").rsplit("/", 1)[-1]


def read_class_nodes(fs: HostFS, cls: str) -> list[int]:
    """Raw (unfolded) NUMA nodes of the usable entries of sysfs class `cls`
    (ubcore), in entry order (the driver's device order: the logical ids).

    Entries whose device/ub_totalues is 0 have no usable unit and are skipped.
    """
    raw_nodes: list[int] = []
    for name in sorted(fs.listdir(cls), key=natural_key):
        d = f"{cls}/{name}/device"
        total = fs.read_optional(f"{d}/ub_totalues")
        if total is None or parse_int_text(total, f"{d}/ub_totalues", "ub_totalues") == 0:
            continue
        numa = fs.read_optional(f"{d}/numa")
        raw_nodes.append(-1 if numa is None else parse_int_text(numa, f"{d}/numa", "ubcore numa"))
    return raw_nodes


def fold_ascend_node(raw: int, index: int) -> int:
    """ubcore reports one node per NPU pair's socket half; NPUs alternate
    between the two nodes of that pair (DeepInfer deep_cluster's folding)."""
    return (raw // 2) * 2 + index % 2


def _fold_class_nodes(
    fs: HostFS, cls: str, found: Found, nodes: tuple[Node, ...]
) -> tuple[tuple[Device, ...], tuple[str, ...]]:
    """`found` with the NUMA nodes the sysfs class gives, where they fold to online nodes."""
    warnings: list[str] = []
    raw_nodes: list[int | None] = list(read_class_nodes(fs, cls))
    node_ids = {n.id for n in nodes}
    if raw_nodes and len(raw_nodes) != len(found):
        warnings.append(
            f"{len(raw_nodes)} usable {cls} entries for {len(found)} NPUs: "
            "ignoring ubcore NUMA nodes"
        )
        raw_nodes = []
    result: list[Device] = []
    for (device, pci_warning), raw in zip(found, raw_nodes or [None] * len(found), strict=True):
        folded = None if raw is None or raw < 0 else fold_ascend_node(raw, device.index)
        if folded is not None and folded in node_ids:
            result.append(replace(device, numa_node=folded, locality="ubcore", local_cpus=None))
            continue
        if folded is not None:
            warnings.append(f"{device.label}: ubcore numa {raw} folds to node {folded}, not online")
        if pci_warning:
            warnings.append(pci_warning)
        elif device.locality == "unknown":
            warnings.append(
                f"{device.label}: no PCI function or ubcore node: NUMA node unknown, "
                "planning it by global slice"
            )
        result.append(device)
    return tuple(result), tuple(warnings)


def read_config_pci(
    fs: HostFS, bdfs: tuple[str, ...], nodes: tuple[Node, ...]
) -> tuple[tuple[Device, ...], tuple[str, ...]]:
    """Devices named by address in the config, index = position in the list."""
    devices: list[Device] = []
    warnings: list[str] = []
    for index, bdf in enumerate(bdfs):
        pid = read_pci_id(fs, bdf.lower())
        if pid is None:
            raise TopologyError(
                f"config device {bdf!r} not found: no {PCI_DIR}/{bdf.lower()}/vendor",
                f"{PCI_DIR}/{bdf.lower()}",
            )
        device, warning = _pci_device(fs, PCI.name, index, pid, nodes)
        devices.append(device)
        if warning:
            warnings.append(warning)
    return tuple(devices), tuple(warnings)


def cpu_standins(
    nodes: tuple[Node, ...], allowed_cpus: frozenset[int], cpu_ranks: int
) -> tuple[Device, ...]:
    """One `cpu` device per node with allowed CPUs; at least `cpu_ranks` of them,
    extra ones round-robin over those nodes."""
    usable = [n.id for n in nodes if n.cpus & allowed_cpus]
    if not usable:
        # No node lists an allowed CPU (garbled or missing node cpulists):
        # stand-ins of unknown locality, which the planner slices globally.
        return tuple(Device(CPU.name, i, None, None, "unknown") for i in range(max(1, cpu_ranks)))
    count = max(len(usable), cpu_ranks)
    return tuple(
        Device(CPU.name, i, None, usable[i % len(usable)], "numa_node") for i in range(count)
    )
