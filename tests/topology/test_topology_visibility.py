"""Visibility variables with the CUDA meaning (contracts §1), in their order (contracts §3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.cpulist import parse_cpulist
from supervisor.errors import TopologyError
from supervisor.examples.builder import FakeHost
from supervisor.examples.hosts import (
    UUID_CONTAINER_CPUS,
    UUID_CONTAINER_ORDER,
    UUID_CONTAINER_UUIDS,
    UUID_CONTAINER_VISIBLE,
    container_uuid,
)
from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions


@pytest.fixture(scope="module")
def gpus4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    host = FakeHost(tmp_path_factory.mktemp("v")).cpus(2, 4, 1)
    for i, bus in enumerate(["1b", "43", "9d", "c3"]):
        host.nvidia_gpu(f"0000:{bus}:00.0", i // 2, uuid=f"GPU-{i}{i}{i}-0000")
    return host.build()


def _visible(root: Path, **env: str) -> list[int]:
    """Indices of the visible devices in ordinal order (cuda:0 first)."""
    topo = read_topology(HostFS(str(root)), DiscoveryOptions(env=tuple(env.items())))
    assert len(topo.devices) == 4  # hidden devices stay
    assert [d.index for d in topo.devices] == [0, 1, 2, 3]  # listed in host order
    assert all((d.ordinal is None) != d.visible for d in topo.devices)
    shown = sorted((d for d in topo.devices if d.visible), key=lambda d: d.ordinal or 0)
    assert [d.ordinal for d in shown] == list(range(len(shown)))
    return [d.index for d in shown]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("-1", []),
        ("2,0", [2, 0]),  # the list's order is CUDA's ordinal order
        (" 3 ", [3]),
        ("1,-1,2", [1]),  # a negative entry ends the list, as in CUDA
        ("GPU-222", [2]),
        ("GPU-111-0000,0", [1, 0]),
        ("3,GPU-000,2,GPU-1", [3, 0, 2, 1]),
        ("2,2,0", [2, 0]),  # a repeated device counts once
    ],
)
def test_cuda_visible_devices(gpus4: Path, value: str | None, expected: list[int]) -> None:
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert _visible(gpus4, **env) == expected


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("4", "index 4"), ("GPU-9", "matches no GPU"), ("GPU-", "ambiguous"), ("abc", "'abc'")],
)
def test_bad_cuda_visible_devices(gpus4: Path, value: str, fragment: str) -> None:
    with pytest.raises(TopologyError) as err:
        _visible(gpus4, CUDA_VISIBLE_DEVICES=value)
    assert "CUDA_VISIBLE_DEVICES" in str(err.value) and fragment in str(err.value)


def test_other_kinds_ignore_cuda_variable(tmp_path: Path) -> None:
    root = FakeHost(tmp_path).cpus(1, 2, 1).build()
    topo = read_topology(HostFS(str(root)), DiscoveryOptions(env=(("CUDA_VISIBLE_DEVICES", "7"),)))
    assert [d.visible for d in topo.devices] == [True]


def test_rocr_then_hip(tmp_path: Path) -> None:
    host = FakeHost(tmp_path).cpus(2, 4, 1)
    for i, bus in enumerate(["05", "26", "85", "a6"]):
        host.amd_gpu(f"0000:{bus}:00.0", i // 2)
    root = host.build()
    env = (("ROCR_VISIBLE_DEVICES", "1,2,3"), ("HIP_VISIBLE_DEVICES", "0,2"))
    topo = read_topology(HostFS(str(root)), DiscoveryOptions(env=env))
    assert [d.index for d in topo.devices if d.visible] == [1, 3]
    # HIP indexes into ROCR's list in ROCR's order; the ordinals follow both.
    env = (("ROCR_VISIBLE_DEVICES", "3,0,2"), ("HIP_VISIBLE_DEVICES", "2,0"))
    topo = read_topology(HostFS(str(root)), DiscoveryOptions(env=env))
    assert {d.index: d.ordinal for d in topo.devices} == {0: None, 1: None, 2: 0, 3: 1}


def test_ascend_visible(tmp_path: Path) -> None:
    host = FakeHost(tmp_path).cpus(2, 4, 1)
    host.ascend_npu("0000:01:00.0", 0).ascend_npu("0000:81:00.0", 1)
    opts = DiscoveryOptions(env=(("ASCEND_RT_VISIBLE_DEVICES", "1"),))
    root = host.build()
    topo = read_topology(HostFS(str(root)), opts)
    assert [(d.index, d.visible) for d in topo.devices] == [(0, False), (1, True)]
    opts = DiscoveryOptions(env=(("ASCEND_RT_VISIBLE_DEVICES", "1,0"),))
    topo = read_topology(HostFS(str(root)), opts)
    assert [(d.index, d.ordinal) for d in topo.devices] == [(0, 1), (1, 0)]


def test_without_a_list_ordinals_follow_pci_bus_order(gpus4: Path) -> None:
    topo = read_topology(HostFS(str(gpus4)))
    assert [(d.bdf, d.ordinal) for d in topo.devices] == [
        ("0000:1b:00.0", 0),
        ("0000:43:00.0", 1),
        ("0000:9d:00.0", 2),
        ("0000:c3:00.0", 3),
    ]


def test_container_uuid_list_gives_ordinals_in_its_order(tmp_path: Path) -> None:
    root = container_uuid(tmp_path)
    opts = DiscoveryOptions(env=(("CUDA_VISIBLE_DEVICES", UUID_CONTAINER_VISIBLE),))
    topo = read_topology(HostFS(str(root)), opts)
    ordinals = {d.index: d.ordinal for d in topo.devices if d.visible}
    assert ordinals == {i: pos for pos, i in enumerate(UUID_CONTAINER_ORDER)}
    assert [d.uuid for d in topo.devices] == list(UUID_CONTAINER_UUIDS)
    assert topo.allowed.cpus == parse_cpulist(UUID_CONTAINER_CPUS)
