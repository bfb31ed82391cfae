"""Key facts of every fixture host in tests/hosts.py, as discovery sees them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.cpulist import parse_cpulist
from supervisor.examples import hosts
from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology
from supervisor.topology.model import Topology
from supervisor.topology.render import render_topology_text, topology_to_doc


def _read(builder, tmp_path: Path) -> Topology:  # type: ignore[no-untyped-def]
    return read_topology(HostFS(str(builder(tmp_path))))


def _nodes(topo: Topology) -> list[int | None]:
    return [d.numa_node for d in topo.devices]


@pytest.mark.parametrize("name", sorted(hosts.ALL_HOSTS))
def test_every_host_is_consistent_and_deterministic(name: str, tmp_path: Path) -> None:
    topo = _read(hosts.ALL_HOSTS[name], tmp_path / "a")
    again = _read(hosts.ALL_HOSTS[name], tmp_path / "b")
    assert topo == again
    assert json.dumps(topology_to_doc(topo)) == json.dumps(topology_to_doc(again))
    assert topo.allowed.cpus <= topo.online
    for cpu in topo.cpus:
        assert cpu.id in cpu.siblings and cpu.siblings <= topo.online
        assert all(topo.cpu(s).siblings == cpu.siblings for s in cpu.siblings)
        assert cpu.node in {n.id for n in topo.nodes}
    assert [(d.kind, d.index) for d in topo.devices] == sorted(
        (d.kind, d.index) for d in topo.devices
    )
    assert render_topology_text(topo).count("\n") > len(topo.nodes)


def test_dgx_h100(tmp_path: Path) -> None:
    topo = _read(hosts.dgx_h100, tmp_path)
    assert len(topo.cpus) == 224
    assert topo.cpu(3).siblings == {3, 115}
    assert topo.node(1).cpus == parse_cpulist("56-111,168-223")
    assert _nodes(topo) == [0, 0, 0, 0, 1, 1, 1, 1]
    ib = [n for n in topo.nics if n.kind == "infiniband"]
    assert len(ib) == 12 and {n.numa_node for n in ib} == {0, 1}
    assert next(n for n in ib if n.name == "mlx5_0").bdf == "0000:18:00.0"


def test_dgx_a100_nps4_gpu_nodes_do_not_follow_gpu_order(tmp_path: Path) -> None:
    topo = _read(hosts.dgx_a100_nps4, tmp_path)
    assert len(topo.nodes) == 8
    assert _nodes(topo) == [3, 3, 1, 1, 7, 7, 5, 5]
    assert topo.node(3).cpus == parse_cpulist("48-63,176-191")
    assert topo.node(0).distance_to(3) == 12 and topo.node(0).distance_to(4) == 32


def test_gb200_hbm_nodes_cpuless(tmp_path: Path) -> None:
    topo = _read(hosts.gb200_tray, tmp_path)
    assert [n.id for n in topo.nodes] == list(range(18))
    for n in hosts.GB200_HBM_NODES:
        assert topo.node(n).cpus == frozenset()
    assert topo.node(2).mem_total_bytes > 0 and topo.node(3).mem_total_bytes == 0
    assert _nodes(topo) == [0, 0, 1, 1]
    assert all(len(c.siblings) == 1 for c in topo.cpus)
    assert topo.node(0).distance_to(2) < topo.node(1).distance_to(2)


def test_ascend_a3_folding(tmp_path: Path) -> None:
    topo = _read(hosts.ascend_a3, tmp_path)
    assert len(topo.cpus) == 640 and len(topo.nodes) == 8
    assert topo.cpu(0).siblings == {0, 1}
    npus = topo.devices
    assert len(npus) == 16 and {d.kind for d in npus} == {"ascend"}
    assert {d.locality for d in npus} == {"ubcore"}
    # raw ubcore node 2*socket, folded by index parity; udma8 (0 UEs) skipped
    assert _nodes(topo) == [2 * (i // 4) + i % 2 for i in range(16)]


def test_mi300x_count_excludes_bmc_and_bridges(tmp_path: Path) -> None:
    topo = _read(hosts.mi300x, tmp_path)
    assert [d.kind for d in topo.devices] == ["amd"] * 8
    assert "0000:c2:00.0" not in {d.bdf for d in topo.devices}
    assert "0000:e8:00.0" not in {d.bdf for d in topo.devices}
    assert _nodes(topo) == [0] * 4 + [1] * 4


def test_five_three(tmp_path: Path) -> None:
    assert _nodes(_read(hosts.five_three, tmp_path)) == [0] * 5 + [1] * 3


def test_adjacent_smt(tmp_path: Path) -> None:
    topo = _read(hosts.adjacent_smt, tmp_path)
    assert topo.cpu(0).siblings == {0, 1} and topo.cpu(33).siblings == {32, 33}
    assert topo.node(0).cpus == frozenset(range(32))


def test_container_holes(tmp_path: Path) -> None:
    topo = _read(hosts.container_holes, tmp_path)
    assert topo.allowed.cpus == parse_cpulist(hosts.CONTAINER_ALLOWED)
    assert topo.allowed.cgroup_path == "/kubepods.slice/pod-a/cri-b"
    assert topo.cpu(2).siblings == {2, 50}  # sibling outside the cpuset is still a sibling


def test_numa_unknown(tmp_path: Path) -> None:
    topo = _read(hosts.numa_unknown, tmp_path)
    assert [(d.numa_node, d.locality) for d in topo.devices] == [
        (1, "local_cpulist"),
        (None, "unknown"),
        (0, "numa_node"),
    ]
    assert len(topo.warnings) == 1 and "0000:5e:00.0" in topo.warnings[0]


def test_no_accel_2node(tmp_path: Path) -> None:
    topo = _read(hosts.no_accel_2node, tmp_path)
    assert [(d.kind, d.numa_node) for d in topo.devices] == [("cpu", 0), ("cpu", 1)]
    (eth0,) = topo.nics
    assert (eth0.name, eth0.numa_node, eth0.irqs) == ("eth0", 1, (60, 61, 62))
