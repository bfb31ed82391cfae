"""snapshot: copy what discovery read; reading the copy reproduces the topology."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.errors import ConfigError
from supervisor.examples import hosts
from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions
from supervisor.topology.snapshot import take_snapshot


@pytest.mark.parametrize("name", ["dgx_h100", "ascend_a3", "mi300x", "container_holes"])
def test_fixture_round_trip(name: str, tmp_path: Path) -> None:
    root = hosts.ALL_HOSTS[name](tmp_path / "src")
    out = tmp_path / "snap"
    count = take_snapshot(str(root), str(out), DiscoveryOptions())
    assert count > 10
    assert read_topology(HostFS(str(out))) == read_topology(HostFS(str(root)))
    # Only what discovery read was copied: cpumap is written by FakeHost but never read.
    assert not (out / "sys/devices/system/node/node0/cpumap").exists()


@pytest.mark.skipif(not os.path.isdir("/sys/bus/pci/devices"), reason="needs sysfs")
def test_live_round_trip(tmp_path: Path) -> None:
    opts = DiscoveryOptions(pci_devices=("0000:00:04.0",))
    if not os.path.exists("/sys/bus/pci/devices/0000:00:04.0"):
        opts = DiscoveryOptions()
    out = tmp_path / "snap"
    take_snapshot("/", str(out), opts)
    live = read_topology(HostFS("/"), opts)
    snap = read_topology(HostFS(str(out)), opts)
    assert (snap.cpus, snap.nodes, snap.devices, snap.nics) == (
        live.cpus,
        live.nodes,
        live.devices,
        live.nics,
    )
    assert [(i.number, i.name, i.bdf) for i in snap.irqs] == [
        (i.number, i.name, i.bdf) for i in live.irqs
    ]
    assert snap.allowed == live.allowed  # same cgroup: this test process
    # The copy holds plain files and relative links only: nothing points outside it.
    for dirpath, dirnames, filenames in os.walk(out):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                assert not os.path.isabs(os.readlink(path)), path


def test_refuses_non_empty_out(tmp_path: Path) -> None:
    root = hosts.no_accel_2node(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("keep me")
    with pytest.raises(ConfigError, match="not an empty directory"):
        take_snapshot(str(root), str(out), DiscoveryOptions())
    assert (out / "x").read_text() == "keep me"
