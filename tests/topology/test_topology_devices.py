"""Accelerator, config-PCI, stand-in and NIC discovery against FakeHost trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.errors import TopologyError
from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from supervisor.topology.devices import fold_ascend_node, parse_nvidia_information
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions, Topology


def _topo(root: Path, **kw: object) -> Topology:
    return read_topology(HostFS(str(root)), DiscoveryOptions(**kw))  # type: ignore[arg-type]


def test_nvidia_index_is_bus_order_and_info_parsed(tmp_path: Path) -> None:
    root = (
        FakeHost(tmp_path)
        .cpus(2, 4, 1)
        .nvidia_gpu("0000:af:00.0", 1, uuid="GPU-bbbb")
        .nvidia_gpu("0000:1b:00.0", 0, uuid="GPU-aaaa", model="NVIDIA A100")
        .build()
    )
    devs = _topo(root).devices
    assert [(d.index, d.bdf, d.numa_node) for d in devs] == [
        (0, "0000:1b:00.0", 0),
        (1, "0000:af:00.0", 1),
    ]
    assert devs[0].uuid == "GPU-aaaa" and devs[0].name == "NVIDIA A100"
    assert devs[0].locality == "numa_node" and devs[0].irqs


def test_nvidia_fallback_to_dev_nodes(tmp_path: Path) -> None:
    host = FakeHost(tmp_path).cpus(2, 4, 1)
    host.nvidia_gpu("0000:1b:00.0", 0, proc_entry=False).nvidia_gpu(
        "0000:af:00.0", 1, proc_entry=False
    )
    topo = _topo(host.build())
    assert [(d.kind, d.index, d.bdf, d.locality) for d in topo.devices] == [
        ("nvidia", 0, None, "unknown"),
        ("nvidia", 1, None, "unknown"),
    ]
    assert len(topo.warnings) == 2 and "dev/nvidia0" in topo.warnings[0]


def test_parse_nvidia_information() -> None:
    info = parse_nvidia_information(
        "Model: \t\t Tesla T4\nGPU UUID: \t GPU-1234-ab\nBus Location: \t 0000:3B:00.0\n"
    )
    assert (info.model, info.uuid, info.bus_location) == ("Tesla T4", "GPU-1234-ab", "0000:3b:00.0")


def test_local_cpulist_narrower_gives_node(tmp_path: Path) -> None:
    root = (
        FakeHost(tmp_path).cpus(2, 4, 1).nvidia_gpu("0000:1b:00.0", -1, local_cpulist="4-6").build()
    )
    d = _topo(root).devices[0]
    assert (d.numa_node, d.locality, d.local_cpus) == (1, "local_cpulist", {4, 5, 6})


def test_unknown_locality_warns(tmp_path: Path) -> None:
    root = (
        FakeHost(tmp_path).cpus(2, 4, 1).nvidia_gpu("0000:1b:00.0", -1, local_cpulist="0-7").build()
    )
    topo = _topo(root)
    assert (topo.devices[0].numa_node, topo.devices[0].locality) == (None, "unknown")
    assert "0000:1b:00.0" in topo.warnings[0] and "numa_node -1" in topo.warnings[0]


def test_amd_needs_compute_driver_and_class(tmp_path: Path) -> None:
    root = (
        FakeHost(tmp_path)
        .cpus(2, 4, 1)
        .amd_gpu("0000:05:00.0", 0)
        .amd_gpu("0000:85:00.0", 1, class_=0x038000)
        .amd_gpu("0000:c5:00.0", 1, class_=0x030000)  # VGA: not counted
        .amd_gpu("0000:d5:00.0", 1, driver=None)  # unbound: not counted
        .pci_device("0000:e1:00.0", 0x1A03, 0x2000, 0x030000, 1, driver="ast")
        .build()
    )
    devs = _topo(root).devices
    assert [(d.kind, d.bdf, d.numa_node) for d in devs] == [
        ("amd", "0000:05:00.0", 0),
        ("amd", "0000:85:00.0", 1),
    ]


def test_amd_without_kfd_is_ignored(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(1, 4, 1).amd_gpu("0000:05:00.0", 0).remove("dev/kfd").build()
    topo = _topo(root)
    assert [d.kind for d in topo.devices] == ["cpu"]
    assert "dev/kfd" in topo.warnings[0]


@pytest.mark.parametrize(
    ("raw", "index", "folded"), [(0, 0, 0), (0, 1, 1), (1, 2, 0), (3, 3, 3), (4, 1, 5), (5, 6, 4)]
)
def test_fold_ascend_node(raw: int, index: int, folded: int) -> None:
    assert fold_ascend_node(raw, index) == folded


def test_ascend_ubcore_folding_and_skip(tmp_path: Path) -> None:
    host = FakeHost(tmp_path).cpus(2, 4, 1, nodes_per_socket=2)
    for i in range(4):
        host.ascend_npu(f"0000:{i + 1:02x}:00.0", -1, ubcore_numa=2 * (i // 2))
        if i == 1:
            host.ubcore_entry("udma2", 0, 3)
    topo = _topo(host.build())
    assert [(d.index, d.numa_node, d.locality) for d in topo.devices] == [
        (0, 0, "ubcore"),
        (1, 1, "ubcore"),
        (2, 2, "ubcore"),
        (3, 3, "ubcore"),
    ]
    # PCI numa_node -1 no longer matters; without npu-smi captures or the
    # config's logical_ids, PCI bus order is assumed, and said.
    assert len(topo.warnings) == 1 and "logical ids unknown" in topo.warnings[0]


def test_ascend_without_pci_uses_davinci_nodes(tmp_path: Path) -> None:
    host = FakeHost(tmp_path).cpus(2, 4, 1)
    host.ascend_npu(None, ubcore_numa=0).ascend_npu(None, ubcore_numa=0)
    topo = _topo(host.build())
    assert [(d.kind, d.bdf, d.numa_node) for d in topo.devices] == [
        ("ascend", None, 0),
        ("ascend", None, 1),
    ]


def test_config_pci_devices(tmp_path: Path) -> None:
    root = (
        FakeHost(tmp_path)
        .cpus(2, 4, 1)
        .pci_device("0000:41:00.0", 0x1AF4, 0x1041, 0x020000, 1, irqs=[50, 51])
        .pci_device("0000:21:00.0", 0x144D, 0xA808, 0x010802, 0, irqs=[60])
        .build()
    )
    devs = _topo(root, pci_devices=("0000:41:00.0", "0000:21:00.0")).devices
    assert [(d.kind, d.index, d.bdf, d.numa_node, d.irqs) for d in devs] == [
        ("pci", 0, "0000:41:00.0", 1, (50, 51)),
        ("pci", 1, "0000:21:00.0", 0, (60,)),
    ]
    with pytest.raises(TopologyError, match=r"0000:99:00\.0"):
        _topo(root, pci_devices=("0000:99:00.0",))


def test_cpu_standins(tmp_path: Path) -> None:
    two = FakeHost(tmp_path / "a").cpus(2, 4, 1).build()
    assert [(d.kind, d.index, d.numa_node) for d in _topo(two).devices] == [
        ("cpu", 0, 0),
        ("cpu", 1, 1),
    ]
    assert [d.numa_node for d in _topo(two, cpu_ranks=3).devices] == [0, 1, 0]
    one = FakeHost(tmp_path / "b").cpus(1, 4, 1).build()
    assert [(d.index, d.numa_node) for d in _topo(one, cpu_ranks=2).devices] == [(0, 0), (1, 0)]
    # Only nodes with allowed CPUs get one.
    part = FakeHost(tmp_path / "c").cpus(2, 4, 1).allowed("4-7", "0-1").build()
    assert [d.numa_node for d in _topo(part).devices] == [1]


def test_forced_accelerator(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(2, 4, 1).nvidia_gpu("0000:1b:00.0", 0).build()
    assert [d.kind for d in _topo(root, accelerator="cpu").devices] == ["cpu", "cpu"]
    with pytest.raises(TopologyError, match="'ascend'"):
        _topo(root, accelerator="ascend")


def test_nics_and_irq_names(tmp_path: Path) -> None:
    host = (
        FakeHost(tmp_path)
        .cpus(2, 4, 1)
        .nic("0000:18:00.0", 0, ib="mlx5_0", netdev="ibp24s0", n_irqs=2)
        .pci_device("0000:3b:00.0", 0x8086, 0x1572, 0x020000, 1, driver="i40e")
        .netdev("eth0", "0000:3b:00.0")
        .virtual_netdev("lo")
        # An ARM-style line: no bdf in chip or action, only the netdev name.
        .interrupt(77, "eth0-TxRx-0", chip="ITS-MSI", hwirq="524288 Edge")
    )
    topo = _topo(host.build())
    nics = {n.name: n for n in topo.nics}
    assert set(nics) == {"mlx5_0", "ibp24s0", "eth0"}
    assert nics["mlx5_0"].kind == "infiniband" and nics["mlx5_0"].numa_node == 0
    assert nics["mlx5_0"].irqs == nics["ibp24s0"].irqs and len(nics["mlx5_0"].irqs) == 2
    assert nics["eth0"].irqs == (77,) and nics["eth0"].numa_node == 1
    irq = next(i for i in topo.irqs if i.number == 77)
    assert irq.bdf == "0000:3b:00.0"


def test_cpu_standins_without_any_node_cpus_have_unknown_locality() -> None:
    """No node lists an allowed CPU: stand-ins of unknown locality (which the planner
    slices globally), not a ZeroDivisionError."""
    from supervisor.topology.devices import cpu_standins  # noqa: PLC0415
    from supervisor.topology.model import Node  # noqa: PLC0415

    devices = cpu_standins((Node(0, frozenset(), 1 << 30, ((0, 10),)),), frozenset({0, 1}), 2)
    assert [(d.kind, d.numa_node, d.locality) for d in devices] == [("cpu", None, "unknown")] * 2
