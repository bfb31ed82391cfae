"""kernel.numa_balancing: read from the host, kept by `snapshot`, shown in topology,
/placement and a metric (docs/operations.md, AutoNUMA)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.hostfs import HostFS
from supervisor.serve.documents import placement_doc
from supervisor.state import StateStore
from supervisor.topology.discover import read_topology
from supervisor.topology.kernel import NUMA_BALANCING, read_numa_balancing
from supervisor.topology.model import DiscoveryOptions
from supervisor.topology.render import render_topology_text, topology_to_doc
from supervisor.topology.snapshot import take_snapshot
from tests.serve.test_metrics import build_registry, realistic_snapshot


def test_the_hosts_value_is_the_kernels() -> None:
    live = Path("/proc/sys/kernel/numa_balancing")
    expected = int(live.read_text()) if live.exists() else None
    assert read_numa_balancing(HostFS("/")) == expected
    assert read_topology(HostFS("/")).numa_balancing == expected


@pytest.mark.parametrize(("text", "value"), [("1\n", 1), ("0", 0), ("2\n", 2), ("x\n", None)])
def test_a_host_tree_value_and_a_garbled_one(tmp_path: Path, text: str, value: int | None) -> None:
    path = tmp_path / NUMA_BALANCING
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert read_numa_balancing(HostFS(str(tmp_path))) == value
    assert read_numa_balancing(HostFS(str(tmp_path / "none"))) is None  # no such file: none


def test_snapshot_keeps_it_and_every_view_shows_it(tmp_path: Path) -> None:
    out = tmp_path / "snap"
    take_snapshot("/", str(out), DiscoveryOptions())
    live = read_topology(HostFS("/")).numa_balancing
    topo = read_topology(HostFS(str(out)))
    assert topo.numa_balancing == live
    assert topology_to_doc(topo)["numa_balancing"] == live
    on = replace(topo, numa_balancing=1)
    assert "kernel.numa_balancing: 1" in render_topology_text(on)
    store = StateStore(realistic_snapshot())
    store.update(topology=replace(store.snapshot.topology, numa_balancing=1))
    assert placement_doc(store.snapshot)["supervisor"]["numa_balancing"] == 1
    assert build_registry(store).get_sample_value("placement_numa_balancing") == 1.0
    store.update(topology=replace(store.snapshot.topology, numa_balancing=None))
    assert build_registry(store).get_sample_value("placement_numa_balancing") is None
