"""CPU and NUMA readers against FakeHost trees (real files under tmp_path)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from supervisor.cpulist import format_cpulist, parse_cpulist
from supervisor.examples.builder import GIB, FakeHost
from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology


@given(st.frozensets(st.integers(min_value=0, max_value=4095), max_size=200))
def test_cpulist_round_trip(ids: frozenset[int]) -> None:
    assert parse_cpulist(format_cpulist(ids)) == ids


def test_intel_numbering_siblings_n_and_n_plus_cores(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(2, 4, 2, "intel").build()
    topo = read_topology(HostFS(str(root)))
    assert topo.cpu(1).siblings == {1, 9}
    assert topo.cpu(9).siblings == {1, 9}
    assert topo.cpu(5).package == 1 and topo.cpu(5).core == 1
    assert topo.node(0).cpus == {0, 1, 2, 3, 8, 9, 10, 11}
    assert [c.node for c in topo.cpus] == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4


def test_adjacent_numbering(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(2, 4, 2, "adjacent").build()
    topo = read_topology(HostFS(str(root)))
    assert topo.cpu(2).siblings == {2, 3}
    assert topo.node(1).cpus == frozenset(range(8, 16))


def test_offline_cpu_never_listed_and_sibling_drops_it(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(1, 4, 2).offline(5).possible_extra(4).build()
    topo = read_topology(HostFS(str(root)))
    assert 5 not in topo.online
    assert topo.cpu(1).siblings == {1}
    assert 5 not in topo.node(0).cpus
    assert 5 not in topo.allowed.cpus
    assert topo.present == frozenset(range(8))
    assert topo.possible == frozenset(range(12))


def test_old_kernel_topology_defaults(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(1, 2, 2).old_topology().build()
    cpu = read_topology(HostFS(str(root))).cpu(0)
    assert (cpu.die, cpu.cluster) == (0, -1)
    assert cpu.siblings == {0, 2}  # from thread_siblings_list


def test_clusters_read(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(1, 8, 1, cores_per_cluster=4).build()
    topo = read_topology(HostFS(str(root)))
    assert [c.cluster for c in topo.cpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_nodes_with_and_without_cpus_and_memory(tmp_path: Path) -> None:
    root = (
        FakeHost(tmp_path)
        .cpus(2, 2, 1, mem_per_node_bytes=4 * GIB)
        .node(2, "", 8 * GIB)  # memory-only (HBM/CXL)
        .node(3, "", 0)  # empty
        .distances([[10, 20, 30, 40], [20, 10, 30, 40], [30, 30, 10, 40], [40, 40, 40, 10]])
        .build()
    )
    topo = read_topology(HostFS(str(root)))
    assert [n.id for n in topo.nodes] == [0, 1, 2, 3]
    assert topo.node(2).cpus == frozenset() and topo.node(2).mem_total_bytes == 8 * GIB
    assert topo.node(3).mem_total_bytes == 0
    assert topo.node(0).mem_total_bytes == 4 * GIB
    assert topo.node(2).distance_to(0) == 30 and topo.node(0).distance_to(3) == 40
    assert topo.allowed.mems == {0, 1, 2}


def test_no_numa_means_one_node(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(1, 4, 1).no_numa().build()
    (root / "proc/meminfo").write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n")
    topo = read_topology(HostFS(str(root)))
    assert len(topo.nodes) == 1 and topo.node(0).cpus == frozenset(range(4))
    assert topo.node(0).mem_total_bytes == 16384000 * 1024
    assert {c.node for c in topo.cpus} == {0}
