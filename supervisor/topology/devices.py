"""Accelerators and stand-ins: NVIDIA, AMD, Ascend, config-named PCI, CPU nodes (reads via HostFS).

No accelerator library is loaded: NVIDIA GPUs come from the driver's procfs
(/proc/driver/nvidia/gpus/<bdf>/information), AMD and Ascend from PCI ids and
their compute drivers, Ascend NUMA folding from /sys/class/ubcore. Devices
come back with `visible=True`; `visibility.apply_visibility` narrows them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from supervisor.errors import TopologyError
from supervisor.hostfs import HostFS
from supervisor.topology.cpus import parse_int_text
from supervisor.topology.model import Device, DeviceKind, Node
from supervisor.topology.pci import (
    BDF_RE,
    PCI_DIR,
    PciId,
    natural_key,
    read_pci_function,
    read_pci_id,
    resolve_locality,
)

NVIDIA_GPUS = "proc/driver/nvidia/gpus"
UBCORE = "sys/class/ubcore"

VENDOR_NVIDIA = 0x10DE
VENDOR_AMD = 0x1002
VENDOR_HUAWEI = 0x19E5


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


def _dev_indices(fs: HostFS, prefix: str) -> list[int]:
    """N of every /dev/<prefix>N (listing /dev, so snapshots carry the names)."""
    return sorted(
        int(name[len(prefix) :])
        for name in fs.listdir("dev")
        if name.startswith(prefix) and name[len(prefix) :].isdigit()
    )


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


def read_nvidia(fs: HostFS, nodes: tuple[Node, ...]) -> tuple[tuple[Device, ...], tuple[str, ...]]:
    """NVIDIA GPUs, indexed in PCI bus order.

    Index = position in sorted bus id order: the order of the driver's minor
    numbers and of CUDA with CUDA_DEVICE_ORDER=PCI_BUS_ID, which deployments
    that use indices in CUDA_VISIBLE_DEVICES set. (CUDA's own default,
    FASTEST_FIRST, only differs on hosts mixing GPU models.)
    """
    warnings: list[str] = []
    devices: list[Device] = []
    entries = [e for e in fs.listdir(NVIDIA_GPUS) if BDF_RE.fullmatch(e)]
    for index, entry in enumerate(sorted(e.lower() for e in entries)):
        rel = f"{NVIDIA_GPUS}/{entry}/information"
        info = parse_nvidia_information(fs.read_required(rel, "NVIDIA GPU information"))
        pid = read_pci_id(fs, entry)
        if pid is None:
            warnings.append(f"nvidia{index} {entry}: no {PCI_DIR}/{entry}: NUMA node unknown")
            devices.append(
                Device("nvidia", index, entry, None, "unknown", uuid=info.uuid, name=info.model)
            )
            continue
        device, warning = _pci_device(
            fs, "nvidia", index, pid, nodes, uuid=info.uuid, name=info.model
        )
        devices.append(device)
        if warning:
            warnings.append(warning)
    if devices:
        return tuple(devices), tuple(warnings)
    # Fallback: device nodes only (driver procfs hidden, e.g. in some containers).
    minors = _dev_indices(fs, "nvidia")
    for index, minor in enumerate(minors):
        warnings.append(
            f"nvidia{index}: only dev/nvidia{minor} found (no {NVIDIA_GPUS}): "
            "bus id and NUMA node unknown, planning it by global slice"
        )
        devices.append(Device("nvidia", index, None, None, "unknown"))
    return tuple(devices), tuple(warnings)


def is_amd_compute(pid: PciId, driver: str | None) -> bool:
    """An AMD GPU that ROCm can use: a display-other (0x0380) or processing
    accelerator (0x12) class function bound to amdgpu. BMC display chips and
    unbound display functions are not."""
    klass = pid.class_code >> 8
    return (
        pid.vendor == VENDOR_AMD and (klass == 0x0380 or klass >> 8 == 0x12) and driver == "amdgpu"
    )


def read_amd(
    fs: HostFS, scan: tuple[PciId, ...], nodes: tuple[Node, ...]
) -> tuple[tuple[Device, ...], tuple[str, ...]]:
    """AMD GPUs in PCI bus order (the KFD topology order ROCm enumerates)."""
    candidates = [
        p
        for p in scan
        if p.vendor == VENDOR_AMD and ((p.class_code >> 8) == 0x0380 or p.class_code >> 16 == 0x12)
    ]
    found = [p for p in candidates if is_amd_compute(p, _driver(fs, p.bdf))]
    if found and "kfd" not in fs.listdir("dev"):
        return (), ("AMD GPUs found but no dev/kfd: amdgpu compute not available, ignoring them",)
    devices: list[Device] = []
    warnings: list[str] = []
    for index, pid in enumerate(found):
        device, warning = _pci_device(fs, "amd", index, pid, nodes)
        devices.append(device)
        if warning:
            warnings.append(warning)
    return tuple(devices), tuple(warnings)


def _driver(fs: HostFS, bdf: str) -> str | None:
    link = fs.readlink(f"{PCI_DIR}/{bdf}/driver")
    return None if link is None else link.rstrip("/").rsplit("/", 1)[-1]


def read_ubcore_nodes(fs: HostFS) -> list[int]:
    """Raw (unfolded) NUMA nodes of the usable ubcore entries, in entry order.

    Entries whose device/ub_totalues is 0 have no usable unit and are skipped.
    """
    raw_nodes: list[int] = []
    for name in sorted(fs.listdir(UBCORE), key=natural_key):
        d = f"{UBCORE}/{name}/device"
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


def read_ascend(
    fs: HostFS, scan: tuple[PciId, ...], nodes: tuple[Node, ...]
) -> tuple[tuple[Device, ...], tuple[str, ...]]:
    """Ascend NPUs: PCI 19e5 processing accelerators, else dev/davinciN nodes."""
    warnings: list[str] = []
    pci = [p for p in scan if p.vendor == VENDOR_HUAWEI and p.class_code >> 16 == 0x12]
    found = [_pci_device(fs, "ascend", index, pid, nodes) for index, pid in enumerate(pci)]
    if not found:
        found = [
            (Device("ascend", i, None, None, "unknown"), None) for i in _dev_indices(fs, "davinci")
        ]
    if not found:
        return (), ()
    raw_nodes: list[int | None] = list(read_ubcore_nodes(fs))
    node_ids = {n.id for n in nodes}
    if raw_nodes and len(raw_nodes) != len(found):
        warnings.append(
            f"{len(raw_nodes)} usable {UBCORE} entries for {len(found)} NPUs: "
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
        device, warning = _pci_device(fs, "pci", index, pid, nodes)
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
        return tuple(Device("cpu", i, None, None, "unknown") for i in range(max(1, cpu_ranks)))
    count = max(len(usable), cpu_ranks)
    return tuple(Device("cpu", i, None, usable[i % len(usable)], "numa_node") for i in range(count))
