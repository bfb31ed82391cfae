"""The accelerator registry: its records agree with the types, and discovery, device
nodes and visibility follow a record (a new kind is a record, found with no other change)."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from supervisor.topology.accelerators import (
    AMD,
    ASCEND,
    BY_NAME,
    DISCOVERED,
    KIND_ORDER,
    KINDS,
    NVIDIA,
    SETTINGS,
    VISIBILITY_VARIABLES,
    AcceleratorKind,
    DeviceKind,
    DeviceNode,
    PciMatch,
    device_index,
    kind_rank,
    or_list,
)
from supervisor.topology.devices import read_kind
from supervisor.topology.pci import scan_pci
from supervisor.topology.visibility import apply_visibility


def test_the_registry_holds_every_kind_of_the_types_once_in_host_order() -> None:
    assert tuple(k.name for k in KINDS) == get_args(DeviceKind)
    assert ("auto", *get_args(DeviceKind)) == SETTINGS
    assert [k.name for k in DISCOVERED] == ["nvidia", "amd", "ascend"]
    assert [kind_rank(k.name) for k in KINDS] == list(range(len(KINDS)))
    assert kind_rank("something-new") == len(KIND_ORDER)
    assert all(BY_NAME[k.name] is k for k in KINDS)


def test_visibility_variables_in_kind_then_precedence_order() -> None:
    assert VISIBILITY_VARIABLES == (
        "CUDA_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ASCEND_RT_VISIBLE_DEVICES",
    )
    # A worker's own variable is one its kind reads; what it drops is another.
    for k in DISCOVERED:
        assert k.worker_var in k.visibility
        assert set(k.worker_drops) <= set(k.visibility) - {k.worker_var}
    assert or_list(("A",)) == "A" and or_list(("A", "B", "C")) == "A, B or C"


@pytest.mark.parametrize(
    ("path", "index"),
    [
        ("/dev/nvidia3", 3),
        ("/dev/davinci1", 1),
        ("/dev/dri/renderD128", 0),
        ("/dev/dri/renderD130", 2),
        ("/dev/dri/renderD12", None),  # below the render base: not a render node
        ("/dev/dri/card0", None),
        ("/dev/nvidiactl", None),
        ("/dev/nvidia-uvm", None),
        ("/dev/davinci_manager", None),
        ("/tmp/dev/nvidia0", None),
    ],
)
def test_device_node_paths_give_the_device_index(path: str, index: int | None) -> None:
    assert device_index(path) == index


def test_device_node_numbers_and_names() -> None:
    render = AMD.device_nodes[0]
    assert str(render) == "dev/dri/renderD{128+N}"
    assert str(NVIDIA.device_nodes[0]) == "dev/nvidia{N}"
    assert NVIDIA.device_nodes[0].number_of("nvidia12") == 12
    assert NVIDIA.device_nodes[0].number_of("nvidiactl") is None


@pytest.mark.parametrize(
    ("kind", "vendor", "class_code", "expected"),
    [
        (AMD, 0x1002, 0x120000, True),  # processing accelerator (MI300X)
        (AMD, 0x1002, 0x038000, True),  # display, other (MI100/MI210)
        (AMD, 0x1002, 0x030000, False),  # a VGA display (a BMC's or a desktop card)
        (AMD, 0x10DE, 0x120000, False),
        (ASCEND, 0x19E5, 0x120000, True),
        (ASCEND, 0x19E5, 0x020000, False),  # a Huawei NIC
        (NVIDIA, 0x10DE, 0x030200, False),  # found by its driver's procfs, not a PCI scan
    ],
)
def test_pci_match_by_vendor_and_class(
    kind: AcceleratorKind, vendor: int, class_code: int, expected: bool
) -> None:
    assert kind.is_device(vendor, class_code) is expected


# A kind the package does not know, as a new record would add it: the generic
# reader finds it by the record alone (PCI ids, class, driver, needed node).
NEW = AcceleratorKind(
    name="pci",  # any registry name: discovery only reads the record's fields
    vendor_ids=(0x1DED,),
    pci=PciMatch(base_classes=(0x12,), driver="newaccel"),
    needs_node="dev/newaccel_ctl",
    device_nodes=(DeviceNode("dev", "newaccel"),),
    visibility=("NEW_VISIBLE_DEVICES",),
    worker_var="NEW_VISIBLE_DEVICES",
)


def _new_host(tmp_path: Path, *, node: bool) -> Path:
    host = FakeHost(tmp_path).cpus(2, 2, 1)
    host.pci_device("0000:41:00.0", 0x1DED, 0x1, 0x120000, 1, driver="newaccel")
    host.pci_device("0000:21:00.0", 0x1DED, 0x1, 0x120000, 0, driver="newaccel")
    host.pci_device("0000:31:00.0", 0x1DED, 0x1, 0x120000, 0, driver=None)  # unbound
    host.pci_device("0000:51:00.0", 0x1DED, 0x2, 0x020000, 1, driver="newaccel")  # a NIC
    if node:
        host.dev_node("newaccel_ctl")
    return host.build()


def test_a_new_kind_is_found_from_its_record_alone(tmp_path: Path) -> None:
    fs = HostFS(str(_new_host(tmp_path, node=True)))
    nodes = ()  # locality resolution is not what this checks
    devices, _ = read_kind(fs, NEW, scan_pci(fs), nodes)
    assert [(d.index, d.bdf) for d in devices] == [(0, "0000:21:00.0"), (1, "0000:41:00.0")]


def test_a_new_kind_without_its_needed_node_is_refused_with_a_warning(tmp_path: Path) -> None:
    fs = HostFS(str(_new_host(tmp_path, node=False)))
    devices, warnings = read_kind(fs, NEW, scan_pci(fs), ())
    assert devices == ()
    assert warnings == (
        "pci devices found but no dev/newaccel_ctl: newaccel compute not available, ignoring them",
    )


def test_visibility_follows_the_record_order(tmp_path: Path) -> None:
    """ROCR selects first and HIP indexes into what it left (AMD's record order)."""
    host = FakeHost(tmp_path).cpus(2, 2, 1)
    for i in range(4):
        host.amd_gpu(f"0000:{0x11 + i:02x}:00.0", i % 2)
    fs = HostFS(str(host.build()))
    devices, _ = read_kind(fs, AMD, scan_pci(fs), ())
    env = {"ROCR_VISIBLE_DEVICES": "1,2,3", "HIP_VISIBLE_DEVICES": "2,0"}
    seen = {d.index: d.ordinal for d in apply_visibility(devices, env) if d.visible}
    assert seen == {3: 0, 1: 1}
