"""The accelerator vocabulary: one record per device kind, and the registry (pure, no I/O).

Each `AcceleratorKind` says how discovery finds the kind (PCI ids and
classes, driver procfs, sysfs classes), which device nodes its devices show
up as, and which environment variables select them. Every other module asks
the registry; adding a kind means a record here (and its tests).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, get_args

DeviceKind = Literal["nvidia", "amd", "ascend", "pci", "cpu"]
"""`pci`: a device named by address in the config; `cpu`: a NUMA node standing
in for a device on a host without accelerators (the demo)."""

AcceleratorSetting = Literal["auto", "nvidia", "amd", "ascend", "pci", "cpu"]
"""The config's `accelerator`: one kind, or `auto` (every kind the host has)."""


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A character device that device N of a kind shows up as: `<dir>/<prefix><base + N>`."""

    dir: str  # relative to the host root: "dev", "dev/dri"
    prefix: str  # "nvidia", "davinci", "renderD"
    base: int = 0  # DRM render minors start at 128 (drm_minor.c, DRM_MINOR_RENDER)

    @property
    def pattern(self) -> re.Pattern[str]:
        """An absolute path of the node, as /proc/<pid>/fd links show it; group 1 the number."""
        return re.compile(rf"^/{re.escape(self.dir)}/{re.escape(self.prefix)}(\d+)$")

    def index_of(self, path: str) -> int | None:
        """The device index an absolute node path names, or None."""
        m = self.pattern.match(path)
        if m is None or int(m.group(1)) < self.base:
            return None
        return int(m.group(1)) - self.base

    def number_of(self, name: str) -> int | None:
        """N of a directory entry `<prefix>N` (the raw number, base not taken off), or None."""
        rest = name[len(self.prefix) :]
        return int(rest) if name.startswith(self.prefix) and rest.isdigit() else None

    def __str__(self) -> str:
        number = f"{self.base}+N" if self.base else "N"
        return f"{self.dir}/{self.prefix}{{{number}}}"


@dataclass(frozen=True, slots=True)
class PciMatch:
    """PCI functions (of the kind's vendor ids) that are devices of a kind: a class, a driver.

    `base_classes` match the class code's top byte (0x12: processing
    accelerator), `subclasses` its top two bytes (0x0380: display, other);
    `driver`, when set, is the driver the function must be bound to.
    """

    base_classes: tuple[int, ...] = ()
    subclasses: tuple[int, ...] = ()
    driver: str | None = None

    def matches_class(self, class_code: int) -> bool:
        """The class matches (the driver is checked apart: it costs a readlink)."""
        return class_code >> 16 in self.base_classes or class_code >> 8 in self.subclasses


@dataclass(frozen=True, slots=True)
class LogicalIds:
    """Where a kind's runtime numbering (logical ids) is read, when it is not PCI bus order.

    `captured_dir` holds the vendor tool's own output, captured to files by
    the operator (or the unit's ExecStartPre) before the supervisor starts:
    `table` the device table (device id, chip id, bus id per chip) and
    `mapping` the (device id, chip id) -> logical id table. Discovery never
    runs the tool itself (it loads no accelerator library and spawns
    nothing); `snapshot` copies the files like any other it reads.
    """

    captured_dir: str  # relative to the host root
    table: str  # file name of the device table capture
    mapping: str  # file name of the logical id mapping capture
    tool: str  # how the operator makes them, for messages and docs


@dataclass(frozen=True, slots=True)
class AcceleratorKind:
    """One device kind: how it is found, its device nodes, its variables.

    `visibility` lists the variables that select devices, in the order they
    apply: each indexes into what the ones before it left (ROCm: ROCR first,
    then HIP). `worker_var` is the one a rank's worker gets naming its own
    device(s); `worker_drops` are removed from the worker's environment then
    (the index is over all devices, so an outer filter must not apply).
    """

    name: DeviceKind
    vendor_ids: tuple[int, ...] = ()  # PCI vendor ids of its devices
    pci: PciMatch | None = None  # found by a PCI scan of `vendor_ids`
    driver_dir: str | None = None  # found by the driver's procfs: one <bdf> entry per device
    device_nodes: tuple[DeviceNode, ...] = ()  # held open by its workers (rank_from = device)
    # The character major of its nodes when the driver numbers them itself
    # (not through sysfs): the driver procfs then says which device a minor is.
    char_major: int | None = None
    node_fallback: DeviceNode | None = None  # found by these nodes when nothing else says
    needs_node: str | None = None  # PCI devices are usable only when this node exists
    numa_class: str | None = None  # a sysfs class whose entries give the devices' NUMA nodes
    visibility: tuple[str, ...] = ()
    uuid_prefix: str | None = None  # visibility entries may name devices by UUID
    worker_var: str | None = None
    worker_drops: tuple[str, ...] = ()
    worker_defaults: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # The shipped example host (supervisor.examples) a config of this kind
    # plans on where none is installed: named in the "no devices" error.
    example: str | None = None
    # The runtime numbers devices by logical id, read from here (None: PCI
    # bus order is the runtime's order, as for CUDA with PCI_BUS_ID).
    logical_ids: LogicalIds | None = None

    @property
    def discovered(self) -> bool:
        """Found on the host by discovery (not named by the config or a stand-in)."""
        return self.pci is not None or self.driver_dir is not None

    def is_device(self, vendor: int, class_code: int) -> bool:
        """A PCI function of this kind by vendor and class (not the driver)."""
        return (
            self.pci is not None
            and vendor in self.vendor_ids
            and self.pci.matches_class(class_code)
        )


NVIDIA = AcceleratorKind(
    name="nvidia",
    vendor_ids=(0x10DE,),
    # Found by the driver's procfs (an information file per GPU: model,
    # UUID, bus id), not by a PCI scan.
    driver_dir="proc/driver/nvidia/gpus",
    device_nodes=(DeviceNode("dev", "nvidia"),),  # the minor number is the index
    # Documentation/admin-guide/devices.txt: "195 char Nvidia graphics devices";
    # each GPU's minor is `Device Minor` in its information file.
    char_major=195,
    node_fallback=DeviceNode("dev", "nvidia"),  # driver procfs hidden (some containers)
    visibility=("CUDA_VISIBLE_DEVICES",),
    uuid_prefix="GPU-",
    worker_var="CUDA_VISIBLE_DEVICES",
    # CUDA numbers devices fastest-first unless told otherwise; the index we
    # pass is the PCI-order index nvidia-smi and /proc/driver use.
    worker_defaults=MappingProxyType({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
    example="dgx-h100",
)

AMD = AcceleratorKind(
    name="amd",
    # A GPU ROCm can use: display-other or processing-accelerator class, bound
    # to amdgpu (BMC display chips and unbound functions are not), with KFD.
    vendor_ids=(0x1002,),
    pci=PciMatch(base_classes=(0x12,), subclasses=(0x0380,), driver="amdgpu"),
    needs_node="dev/kfd",
    device_nodes=(DeviceNode("dev/dri", "renderD", 128),),  # the N-th render node
    # ROCR_VISIBLE_DEVICES selects first, HIP_VISIBLE_DEVICES indexes into
    # what it left, as the ROCm docs describe.
    visibility=("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
    worker_var="HIP_VISIBLE_DEVICES",
    worker_drops=("ROCR_VISIBLE_DEVICES",),
    example="mi300x",
)

ASCEND = AcceleratorKind(
    name="ascend",
    vendor_ids=(0x19E5,),  # Huawei
    pci=PciMatch(base_classes=(0x12,)),  # processing accelerators
    device_nodes=(DeviceNode("dev", "davinci"),),  # the NPU id
    node_fallback=DeviceNode("dev", "davinci"),
    # ubcore reports one node per NPU pair's socket half (folded by index).
    numa_class="sys/class/ubcore",
    visibility=("ASCEND_RT_VISIBLE_DEVICES",),
    worker_var="ASCEND_RT_VISIBLE_DEVICES",
    example="ascend-16npu",
    # The Ascend runtime (ASCEND_RT_VISIBLE_DEVICES, torch_npu) counts NPUs by
    # "Chip Logic ID" of `npu-smi info -m`, which is not PCI bus order on
    # 910B hosts (NPU 0-7 at buses C1, 01, C2, 02, 81, 41, 82, 42). Bus ids
    # per (NPU, chip) come from the `npu-smi info` table.
    logical_ids=LogicalIds(
        captured_dir="run/placement-supervisor/npu-smi",
        table="info.txt",
        mapping="info-m.txt",
        tool="npu-smi info > info.txt; npu-smi info -m > info-m.txt",
    ),
)

PCI = AcceleratorKind(name="pci")  # named by address in the config; any vendor
CPU = AcceleratorKind(name="cpu")  # a NUMA node standing in for a device

# In host order: accelerators before config-named PCI devices before CPU
# stand-ins (devices and ranks sort by it).
KINDS: tuple[AcceleratorKind, ...] = (NVIDIA, AMD, ASCEND, PCI, CPU)
BY_NAME: Mapping[str, AcceleratorKind] = MappingProxyType({k.name: k for k in KINDS})
KIND_ORDER: Mapping[str, int] = MappingProxyType({k.name: i for i, k in enumerate(KINDS)})
# The kinds discovery finds on the host, in the order it looks.
DISCOVERED: tuple[AcceleratorKind, ...] = tuple(k for k in KINDS if k.discovered)
# The `accelerator` config values: every kind, or auto.
AUTO: Literal["auto"] = "auto"
SETTINGS: tuple[AcceleratorSetting, ...] = get_args(AcceleratorSetting)
# Every variable with the CUDA meaning of docs/contracts.md §1, in kind order.
VISIBILITY_VARIABLES: tuple[str, ...] = tuple(v for k in KINDS for v in k.visibility)
VENDOR_IDS: tuple[int, ...] = tuple(v for k in KINDS for v in k.vendor_ids)


def kind(name: str) -> AcceleratorKind:
    """The record of kind `name` (KeyError for one the registry does not hold)."""
    return BY_NAME[name]


def kind_rank(name: str) -> int:
    """Where kind `name` sorts among the kinds (an unknown one last)."""
    return KIND_ORDER.get(name, len(KIND_ORDER))


def device_index(path: str) -> int | None:
    """The device index of an accelerator device node path ("/dev/nvidia3": 3), or None."""
    for k in KINDS:
        for node in k.device_nodes:
            index = node.index_of(path)
            if index is not None:
                return index
    return None


def or_list(names: tuple[str, ...]) -> str:
    """ "A, B or C" (pure)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
