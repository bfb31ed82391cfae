"""Discovery of this machine's real /proc and /sys (2 CPUs, one node, no accelerator)."""

from __future__ import annotations

import os

import pytest

from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions

VIRTIO = "0000:00:04.0"

pytestmark = pytest.mark.skipif(
    not os.path.exists(f"/sys/bus/pci/devices/{VIRTIO}"), reason="not the project's CI VM"
)


def test_live_host() -> None:
    topo = read_topology(HostFS("/"))
    assert topo.online == frozenset(os.sched_getaffinity(0)) | topo.online
    assert len(topo.cpus) == os.cpu_count() == 2
    assert [n.id for n in topo.nodes] == [0]
    assert topo.allowed.cpus == {0, 1} and topo.allowed.mems == {0}
    assert [(d.kind, d.index, d.numa_node) for d in topo.devices] == [("cpu", 0, 0)]
    assert topo.node(0).mem_total_bytes > 1 << 30


def test_live_config_pci_device_with_msix_irqs() -> None:
    topo = read_topology(HostFS("/"), DiscoveryOptions(pci_devices=(VIRTIO,)))
    (dev,) = topo.devices
    assert (dev.kind, dev.bdf, dev.numa_node) == ("pci", VIRTIO, 0)
    assert dev.irqs == (40, 41, 42, 43)
    names = {i.number: i.name for i in topo.irqs if i.bdf == VIRTIO}
    assert names[41] == "virtio3-rx"
