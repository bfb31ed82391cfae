"""Network interfaces backed by PCI functions: InfiniBand HCAs and netdevs (reads via HostFS).

Each /sys/class/{infiniband,net}/<name>/device is a link to the function
(sysfs-class-net, sysfs-class-infiniband); netdevs without it (lo, bridges,
veth) are virtual and skipped. Only the link is read, never files through
it, so a snapshot can carry it as a plain symlink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from supervisor.hostfs import HostFS
from supervisor.topology.model import Nic, Node
from supervisor.topology.pci import (
    bdf_from_link,
    natural_key,
    read_pci_function,
    read_pci_id,
    resolve_locality,
)

CLASSES: tuple[tuple[Literal["infiniband", "net"], str], ...] = (
    ("infiniband", "sys/class/infiniband"),
    ("net", "sys/class/net"),
)


@dataclass(frozen=True, slots=True)
class NicLink:
    name: str
    kind: Literal["infiniband", "net"]
    bdf: str | None


def read_nic_links(fs: HostFS) -> tuple[NicLink, ...]:
    links: list[NicLink] = []
    for kind, base in CLASSES:
        for name in fs.listdir(base):
            target = fs.readlink(f"{base}/{name}/device")
            if target is None:
                continue  # virtual netdev
            bdf = bdf_from_link(target)
            if bdf is None:
                # A virtio netdev's device is the virtio bus device
                # ("../../../virtio2"); the class entry's own link names the
                # PCI function above it (.../0000:00:03.0/virtio2/net/eth0).
                entry = fs.readlink(f"{base}/{name}")
                bdf = None if entry is None else bdf_from_link(entry)
            links.append(NicLink(name, kind, bdf))
    return tuple(links)


def read_nics(fs: HostFS, nodes: tuple[Node, ...]) -> tuple[Nic, ...]:
    """NICs with their PCI function's MSI IRQs (discover adds the /proc/interrupts
    lines that name them), by kind then name."""
    nics: list[Nic] = []
    for link in read_nic_links(fs):
        node: int | None = None
        irqs: tuple[int, ...] = ()
        pid = None if link.bdf is None else read_pci_id(fs, link.bdf)
        if pid is not None:
            fn = read_pci_function(fs, pid)
            node = resolve_locality(link.name, fn.numa_node, fn.local_cpus, nodes).numa_node
            irqs = fn.msi_irqs
        nics.append(Nic(name=link.name, kind=link.kind, bdf=link.bdf, numa_node=node, irqs=irqs))
    return tuple(sorted(nics, key=lambda n: (n.kind, natural_key(n.name))))
