"""Allowed CPUs/nodes: proc/self/status ∩ cgroup cpuset (v1, v2, hybrid) ∩ online."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.errors import TopologyError
from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from supervisor.topology.cgroup import parse_proc_cgroup
from supervisor.topology.discover import read_topology


def _allowed(root: Path):  # type: ignore[no-untyped-def]
    return read_topology(HostFS(str(root))).allowed


def test_status_only(tmp_path: Path) -> None:
    a = _allowed(FakeHost(tmp_path).cpus(2, 4, 1).allowed("1-3,6", "1").build())
    assert a.cpus == {1, 2, 3, 6} and a.mems == {1}
    assert a.cgroup_version == 2  # in the root cgroup without a cpuset controller


def test_cgroup_v2_effective_intersected_with_status(tmp_path: Path) -> None:
    host = FakeHost(tmp_path).cpus(2, 8, 1).allowed("0-11", "0-1")
    a = _allowed(host.cgroup_v2("/kubepods/pod1/ctr", "2-5,9,12-15", "0").build())
    assert a.cpus == {2, 3, 4, 5, 9}
    assert a.mems == {0}
    assert (a.cgroup_version, a.cgroup_path) == (2, "/kubepods/pod1/ctr")


def test_cgroup_v2_walks_up_to_nearest_dir_with_cpuset(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(1, 8, 1).cgroup_v2("/a", "0-3", "0").build()
    # The process sits two levels below /a, where cpuset is not enabled.
    (root / "proc/self/cgroup").write_text("0::/a/b/c\n")
    (root / "sys/fs/cgroup/a/b/c").mkdir(parents=True)
    a = _allowed(root)
    assert a.cpus == {0, 1, 2, 3} and a.cgroup_path == "/a"


def test_cgroup_v1_hybrid_picks_cpuset_hierarchy(tmp_path: Path) -> None:
    a = _allowed(FakeHost(tmp_path).cpus(1, 8, 1).cgroup_v1("/docker/abc", "4-7", "0").build())
    assert a.cpus == {4, 5, 6, 7}
    assert (a.cgroup_version, a.cgroup_path) == (1, "/docker/abc")


def test_cgroup_v1_falls_back_to_configured_masks(tmp_path: Path) -> None:
    root = (
        FakeHost(tmp_path)
        .cpus(1, 8, 1)
        .cgroup_v1("/x", "1-2", "0")
        .remove("sys/fs/cgroup/cpuset/x/cpuset.effective_cpus")
        .remove("sys/fs/cgroup/cpuset/x/cpuset.effective_mems")
        .build()
    )
    assert _allowed(root).cpus == {1, 2}


def test_cgroup_v1_without_namespace_walks_up_to_mount_root(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(1, 8, 1).cgroup_v1("/", "0-5", "0").build()
    (root / "proc/self/cgroup").write_text("3:cpuset:/docker/0123abcd\n")
    a = _allowed(root)
    assert a.cpus == frozenset(range(6)) and a.cgroup_path == "/"


def test_empty_intersection_names_files(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(1, 8, 1).allowed("0-1", "0").cgroup_v2("/s", "4-5", "0")
    with pytest.raises(TopologyError) as err:
        read_topology(HostFS(str(root.build())))
    msg = str(err.value)
    assert "proc/self/status" in msg and "sys/fs/cgroup/s/cpuset.cpus.effective" in msg
    assert "0-1" in msg and "4-5" in msg


def test_parse_proc_cgroup_lines() -> None:
    lines = parse_proc_cgroup("4:memory:/x\n3:cpuset,cpu:/y\n0::/z\n")
    assert lines[1].controllers == ("cpuset", "cpu") and lines[1].path == "/y"
    assert lines[2].hierarchy == 0 and lines[2].controllers == ()
