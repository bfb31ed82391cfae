"""Bad host trees and variables give one TopologyError naming the file/variable and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.errors import TopologyError
from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions


def _error(host: FakeHost, **kw: object) -> TopologyError:
    root = host.build()
    with pytest.raises(TopologyError) as err:
        read_topology(HostFS(str(root)), DiscoveryOptions(**kw))  # type: ignore[arg-type]
    assert err.value.exit_code == 3
    return err.value


def test_garbled_cpulist(tmp_path: Path) -> None:
    rel = "sys/devices/system/node/node1/cpulist"
    e = _error(FakeHost(tmp_path).cpus(2, 2, 1).raw(rel, "2-x\n"))
    assert rel in str(e) and "2-x" in str(e) and e.path == rel


def test_missing_cpu_online(tmp_path: Path) -> None:
    rel = "sys/devices/system/cpu/online"
    e = _error(FakeHost(tmp_path).cpus(1, 2, 1).remove(rel))
    assert rel in str(e) and e.path == rel


def test_garbage_numa_node(tmp_path: Path) -> None:
    host = FakeHost(tmp_path).cpus(2, 2, 1).nvidia_gpu("0000:1b:00.0", "abc")
    e = _error(host)
    assert "sys/bus/pci/devices/0000:1b:00.0/numa_node" in str(e) and "'abc'" in str(e)


def test_empty_cpuset(tmp_path: Path) -> None:
    e = _error(FakeHost(tmp_path).cpus(1, 4, 1).cgroup_v2("/x", "", "0"))
    assert "sys/fs/cgroup/x/cpuset.cpus.effective" in str(e)


def test_unknown_visible_index(tmp_path: Path) -> None:
    host = FakeHost(tmp_path).cpus(1, 4, 1).nvidia_gpu("0000:1b:00.0", 0)
    e = _error(host, env=(("CUDA_VISIBLE_DEVICES", "0,3"),))
    assert "CUDA_VISIBLE_DEVICES='0,3'" in str(e) and "index 3" in str(e)


def test_garbled_distance_and_topology_ids(tmp_path: Path) -> None:
    e = _error(
        FakeHost(tmp_path / "a").cpus(2, 2, 1).raw("sys/devices/system/node/node0/distance", "10\n")
    )
    assert "node0/distance" in str(e) and "2 online nodes" in str(e)
    rel = "sys/devices/system/cpu/cpu1/topology/core_id"
    e = _error(FakeHost(tmp_path / "b").cpus(1, 2, 1).raw(rel, "one\n"))
    assert rel in str(e) and "'one'" in str(e)


def test_garbled_status(tmp_path: Path) -> None:
    text = "Name:\tx\nCpus_allowed_list:\t0-1\n"
    e = _error(FakeHost(tmp_path).cpus(1, 2, 1).raw("proc/self/status", text))
    assert "Mems_allowed_list" in str(e) and "proc/self/status" in str(e)
