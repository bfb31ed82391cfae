"""PCI functions: ids, class, driver, NUMA locality and MSI IRQs (reads via HostFS).

Files: Documentation/ABI/testing/sysfs-bus-pci. `numa_node` is -1 when the
firmware gives no proximity (ACPI _PXM absent); `local_cpulist` is then all
CPUs, or, on some platforms, the CPUs of the root complex's socket.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from supervisor.cpulist import format_cpulist
from supervisor.errors import TopologyError
from supervisor.hostfs import HostFS
from supervisor.topology.cpus import parse_int_text, read_optional_list
from supervisor.topology.model import Locality, Node

PCI_DIR = "sys/bus/pci/devices"

BDF_RE = re.compile(r"\b([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\b")


def normalize_bdf(text: str) -> str | None:
    """A PCI address as sysfs names it ("0000:3b:00.0"), from any spelling
    lspci or nvidia-smi print ("0000:3B:00.0", "00000000:3b:00.0"); None if
    `text` is not one."""
    if not BDF_RE.fullmatch(text):
        return None
    domain, rest = text.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def find_bdf(text: str) -> str | None:
    """The first PCI address ("0000:18:00.0") in `text`, lower-cased."""
    match = BDF_RE.search(text)
    return None if match is None else match.group(1).lower()


def bdf_from_link(target: str) -> str | None:
    """The PCI function a sysfs `device` link points at: its last bdf component.

    ("../../../0000:18:00.0", or ".../0000:00:03.0/virtio2" for a virtio netdev.)
    """
    for part in reversed(target.split("/")):
        if BDF_RE.fullmatch(part):
            return part.lower()
    return None


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key putting "mlx5_10" after "mlx5_9" and "udma10" after "udma9"."""
    return tuple(
        (0, int(tok)) if tok.isdigit() else (1, tok) for tok in re.findall(r"\d+|\D+", name)
    )


@dataclass(frozen=True, slots=True)
class PciId:
    """What every PCI function is scanned for: enough to tell accelerators apart."""

    bdf: str
    vendor: int
    device: int
    class_code: int  # 24 bits: base class, subclass, prog-if (0x030200 = 3D controller)


@dataclass(frozen=True, slots=True)
class PciFunction:
    """A PCI function of interest, with its locality and interrupts."""

    bdf: str
    vendor: int
    device: int
    class_code: int
    numa_node: int  # raw: -1 when unknown
    local_cpus: frozenset[int] | None
    driver: str | None
    msi_irqs: tuple[int, ...]


def parse_hex_text(text: str, rel: str, what: str) -> int:
    body = text.strip()
    try:
        return int(body, 16)
    except ValueError:
        raise TopologyError(f"garbled {what} in {rel}: {body!r} is not hex", rel) from None


def read_pci_id(fs: HostFS, bdf: str) -> PciId | None:
    """vendor/device/class of one function, or None when it does not exist."""
    d = f"{PCI_DIR}/{bdf}"
    vendor = fs.read_optional(f"{d}/vendor")
    if vendor is None:
        return None
    device = fs.read_optional(f"{d}/device") or "0"
    klass = fs.read_optional(f"{d}/class") or "0"
    return PciId(
        bdf=bdf,
        vendor=parse_hex_text(vendor, f"{d}/vendor", "PCI vendor id"),
        device=parse_hex_text(device, f"{d}/device", "PCI device id"),
        class_code=parse_hex_text(klass, f"{d}/class", "PCI class"),
    )


def scan_pci(fs: HostFS) -> tuple[PciId, ...]:
    """Every PCI function on the host, in address order."""
    ids = (read_pci_id(fs, bdf) for bdf in fs.listdir(PCI_DIR))
    return tuple(sorted((i for i in ids if i is not None), key=lambda i: i.bdf))


def read_pci_function(fs: HostFS, pid: PciId) -> PciFunction:
    d = f"{PCI_DIR}/{pid.bdf}"
    text = fs.read_optional(f"{d}/numa_node")
    numa = -1 if text is None else parse_int_text(text, f"{d}/numa_node", "numa_node")
    local = read_optional_list(fs, f"{d}/local_cpulist", "local CPU list")
    link = fs.readlink(f"{d}/driver")
    driver = None if link is None else link.rstrip("/").rsplit("/", 1)[-1]
    irqs = sorted(int(n) for n in fs.listdir(f"{d}/msi_irqs") if n.isdigit())
    return PciFunction(
        bdf=pid.bdf,
        vendor=pid.vendor,
        device=pid.device,
        class_code=pid.class_code,
        numa_node=numa,
        local_cpus=local,
        driver=driver,
        msi_irqs=tuple(irqs),
    )


@dataclass(frozen=True, slots=True)
class Locale:
    """Where a device sits: its node, how we know, and a warning when we don't."""

    numa_node: int | None
    locality: Locality
    local_cpus: frozenset[int] | None
    warning: str | None


def resolve_locality(
    label: str, raw_node: int, local_cpus: frozenset[int] | None, nodes: tuple[Node, ...]
) -> Locale:
    """Pure: the node a device is local to.

    1. numa_node when it names an online node;
    2. else (one node only) that node;
    3. else local_cpulist when narrower than all online CPUs: the node that
       holds most of those CPUs (ties: lowest id);
    4. else unknown (plan by global slice) with a warning.
    """
    node_ids = {n.id for n in nodes}
    online = frozenset().union(*(n.cpus for n in nodes))
    if raw_node in node_ids:
        return Locale(raw_node, "numa_node", None, None)
    if len(nodes) == 1:
        # One node: nothing to be unsure about (single-socket hosts report -1).
        return Locale(nodes[0].id, "numa_node", None, None)
    why = f"numa_node {raw_node}" + ("" if raw_node < 0 else " (not an online node)")
    local = None if local_cpus is None else local_cpus & online
    if local and local < online:
        counts = Counter(n.id for n in nodes for cpu in local if cpu in n.cpus)
        best = min(counts, key=lambda n: (-counts[n], n))
        return Locale(best, "local_cpulist", local, None)
    shown = "missing" if local_cpus is None else format_cpulist(local_cpus)
    return Locale(
        None,
        "unknown",
        None,
        f"{label}: {why} and local_cpulist {shown} spans all CPUs: "
        "NUMA node unknown, planning it by global slice",
    )
