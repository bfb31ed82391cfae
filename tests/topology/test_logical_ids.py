"""Ascend devices numbered as the runtime numbers them (issue 27 item 1, item 6).

Fixture hosts with public `npu-smi info` layouts: an A2 whose logical ids 0-7
sit at buses C1, 01, C2, 02, 81, 41, 82, 42, and the A3 example. The captures
are files in the tree; the config's `logical_ids` overrides them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import parse_config
from supervisor.errors import ConfigError, TopologyError
from supervisor.examples import hosts
from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology
from supervisor.topology.logical_ids import (
    logical_by_bdf,
    parse_device_table,
    parse_logical_map,
)
from supervisor.topology.model import DiscoveryOptions
from supervisor.topology.render import render_topology_text
from supervisor.topology.snapshot import take_snapshot

A2_BY_LOGICAL = [f"0000:{b}:00.0" for b in hosts.A2_BUSES]


def test_a2_devices_are_numbered_by_logical_id_not_pci_order(tmp_path: Path) -> None:
    topo = read_topology(HostFS(str(hosts.ascend_a2(tmp_path))))
    assert [(d.index, d.bdf, d.numa_node) for d in topo.devices] == [
        (0, "0000:c1:00.0", 6),
        (1, "0000:01:00.0", 0),
        (2, "0000:c2:00.0", 6),
        (3, "0000:02:00.0", 0),
        (4, "0000:81:00.0", 4),
        (5, "0000:41:00.0", 2),
        (6, "0000:82:00.0", 4),
        (7, "0000:42:00.0", 2),
    ]
    assert topo.warnings == ()
    assert {d.id_source for d in topo.devices} == {
        "run/placement-supervisor/npu-smi/{info.txt,info-m.txt}"
    }


def test_a2_irqs_follow_the_identity(tmp_path: Path) -> None:
    """Item 6: NPU0's IRQs are those of C1:00.0's msi_irqs, not 01:00.0's."""
    topo = read_topology(HostFS(str(hosts.ascend_a2(tmp_path))))
    irqs = {i.number: i.bdf for i in topo.irqs}
    for d in topo.devices:
        assert d.irqs and all(irqs[n] == d.bdf for n in d.irqs)
    assert topo.devices[0].irqs == (100, 101)  # the first function written: C1:00.0


def test_a3_lowest_bus_is_logical_14(tmp_path: Path) -> None:
    topo = read_topology(HostFS(str(hosts.ascend_a3(tmp_path))))
    by_bus = sorted(topo.devices, key=lambda d: d.bdf or "")
    assert (by_bus[0].bdf, by_bus[0].index) == ("0000:01:00.0", 14)
    assert [d.bdf for d in topo.devices][:2] == ["0000:9d:00.0", "0000:9f:00.0"]
    # ubcore entries are in the driver's (logical) order: logical 14 on socket 3.
    assert topo.devices[14].numa_node == 6


def test_topology_text_shows_logical_id_bus_node_and_irqs(tmp_path: Path) -> None:
    text = render_topology_text(read_topology(HostFS(str(hosts.ascend_a2(tmp_path)))))
    row = next(line for line in text.splitlines() if line.startswith("ascend0 "))
    assert row.split()[:3] == ["ascend0", "0000:c1:00.0", "6"]
    assert row.split()[-1] == "100-101"
    assert "device numbers are the runtime's logical ids, from run/placement-supervisor" in text


def test_parse_table_and_map_of_a3_dump() -> None:
    table = parse_device_table(
        "| 0     Ascend910           | OK            | 93.2  39  0 / 0  |\n"
        "| 0                         | 0000:9D:00.0  | 0  0 / 0  3162 / 65536  |\n"
        "| 1                         | 0000:9F:00.0  | 0  0 / 0  3162 / 65536  |\n"
        "| 0       0                 | 4242          | python  | 3000 |\n"
    )
    assert table == {(0, 0): "0000:9d:00.0", (0, 1): "0000:9f:00.0"}
    mapping = parse_logical_map(
        "  NPU ID   Chip ID   Chip Logic ID   Chip Name\n"
        "  0        0         3               Ascend910\n"
        "  0        1         2               Ascend910\n"
        "  0        2         -               Mcu\n"
    )
    assert mapping == {(0, 0): 3, (0, 1): 2, (0, 2): None}
    assert logical_by_bdf(table, mapping) == {"0000:9d:00.0": 3, "0000:9f:00.0": 2}


def test_an_empty_mapping_capture_gives_no_ids() -> None:
    assert logical_by_bdf({(0, 0): "0000:01:00.0"}, parse_logical_map("npu-smi: error\n")) == {}


def test_no_chip_logic_id_uses_the_npu_id() -> None:
    """Ascend 950 reports no Chip Logic ID: the NPU id is the logical id."""
    table = {(1, 0): "0000:02:00.0", (0, 0): "0000:01:00.0"}
    assert logical_by_bdf(table, {(0, 0): None, (1, 0): None}) == {
        "0000:01:00.0": 0,
        "0000:02:00.0": 1,
    }


def test_config_override_wins_and_is_checked(tmp_path: Path) -> None:
    root = hosts.ascend_a2(tmp_path)
    order = tuple(sorted(A2_BY_LOGICAL))  # claim PCI order
    topo = read_topology(HostFS(str(root)), DiscoveryOptions(logical_ids=order))
    assert [d.bdf for d in topo.devices] == list(order)
    assert {d.id_source for d in topo.devices} == {"config logical_ids"}
    with pytest.raises(TopologyError, match=r"config logical_ids: no logical id for 0000:c2:00.0"):
        read_topology(HostFS(str(root)), DiscoveryOptions(logical_ids=order[:7]))


def test_config_key_is_validated_naming_file_key_and_value() -> None:
    def cfg(ids: list[str]) -> tuple[str, ...]:
        return parse_config(
            {"workers": {"command": "w"}, "logical_ids": ids}, "a2.toml"
        ).logical_ids

    assert cfg(["0000:C1:00.0", "0000:01:00.0"]) == ("0000:c1:00.0", "0000:01:00.0")
    with pytest.raises(ConfigError, match=r"a2.toml: logical_ids: item 1: expected a PCI.*'C1'"):
        cfg(["0000:c1:00.0", "C1"])
    with pytest.raises(ConfigError, match=r"logical_ids: item 1: '0000:c1:00.0' is listed twice"):
        cfg(["0000:c1:00.0", "0000:c1:00.0"])


def test_garbled_capture_falls_back_to_pci_order_with_a_warning(tmp_path: Path) -> None:
    host = FakeHost(tmp_path).cpus(1, 8, 1)
    for bus in ("02", "01"):
        host.ascend_npu(f"0000:{bus}:00.0", 0)
    hosts.npu_smi_capture(host, [(0, 0, 0, "0000:02:00.0", "Ascend 910B3")])
    topo = read_topology(HostFS(str(host.build())))
    assert [d.bdf for d in topo.devices] == ["0000:01:00.0", "0000:02:00.0"]
    assert any("no logical id for 0000:01:00.0; assuming PCI bus order" in w for w in topo.warnings)


def test_snapshot_carries_the_captures_so_plan_reproduces_offline(tmp_path: Path) -> None:
    root = hosts.ascend_a2(tmp_path / "src")
    out = tmp_path / "snap"
    take_snapshot(str(root), str(out), DiscoveryOptions())
    assert (out / "run/placement-supervisor/npu-smi/info-m.txt").is_file()

    def plan(r: Path) -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "supervisor", "plan", "--root", str(r), "--json"],
            capture_output=True,
            text=True,
            check=True,
        )
        return [rank["device"]["bus_id"] for rank in json.loads(proc.stdout)["ranks"]]

    assert plan(out) == plan(root) == A2_BY_LOGICAL


def test_device_row_whose_name_ends_in_digits_is_a_device_row() -> None:
    table = parse_device_table(
        "| 3     950             | OK            | 93.2  39  |\n"
        "| 0                     | 0000:41:00.0  | 0  0 / 0  |\n"
        "| 3       0             | 4242          | python    |\n"
    )
    assert table == {(3, 0): "0000:41:00.0"}
