"""supervisor.plan.replan on fixture hosts: the degrade ladder, fixed ranks, what moved (pure)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.errors import PlanError
from supervisor.hostfs import HostFS
from supervisor.plan.placement import PlanSettings
from supervisor.plan.replan import (
    allowed_of,
    changed_keys,
    mems_changed,
    merge_topology,
    normalize_allowed,
    replan,
    same_processes,
    shortage_ladder,
)
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions, Topology
from tests.support.fakehost import FakeHost


def two_nodes(tmp_path: Path, name: str = "h", allowed: str | None = None) -> Topology:
    """2 nodes x 2 CPUs (node 0 = 0-1, node 1 = 2-3); `allowed` narrows the cpuset."""
    host = FakeHost(tmp_path / name).cpus(2, 2, 1)
    if allowed is not None:
        host.allowed(allowed, "0-1")
    return read_topology(HostFS(str(host.build())), DiscoveryOptions(cpu_ranks=2))


def test_the_ladder_starts_at_the_configured_setting() -> None:
    assert shortage_ladder(None) == (None, "merge", "share")
    assert shortage_ladder("error") == ("error", "merge", "share")
    assert shortage_ladder("merge") == ("merge", "share")
    assert shortage_ladder("share") == ("share",)


def test_node0_cpus_gone_keeps_both_ranks_and_moves_them(tmp_path: Path) -> None:
    before = two_nodes(tmp_path, "before")
    settings = PlanSettings(rank_roles={}, engine=False, on_shortage="error")
    old = replan(before, settings).placement
    fresh = two_nodes(tmp_path, "after", allowed="2-3")
    # Discovery alone would now put both CPU stand-ins on node 1 (the only node
    # with allowed CPUs): rank 0 would change device. merge_topology keeps it.
    assert [d.numa_node for d in fresh.devices] == [1, 1]
    result = replan(merge_topology(fresh, before), settings)
    new = result.placement
    assert same_processes(old, new)
    assert [r.slot.cpus for r in new.ranks] == [(2,), (3,)]
    assert changed_keys(old, new) == (0, 1)
    assert [r.device.numa_node for r in new.ranks] == [0, 1]
    assert not mems_changed(old, new, 0) and not mems_changed(old, new, 1)
    assert result.shortage is None  # fits without degrading


def test_a_shortage_degrades_to_share_with_the_reasons(tmp_path: Path) -> None:
    before = two_nodes(tmp_path, "before")
    settings = PlanSettings(rank_roles={}, on_shortage="error")  # with an engine
    fresh = two_nodes(tmp_path, "after", allowed="2-3")
    result = replan(merge_topology(fresh, before), settings)
    assert result.shortage == "share"
    assert len(result.degraded) == 2 and "on_shortage=error" in result.degraded[0]
    assert result.placement.shared and result.placement.warnings
    cpus = {c for r in result.placement.ranks for c in r.slot.cpus}
    assert cpus <= {2, 3}


def test_no_allowed_cpu_at_all_is_a_plan_error(tmp_path: Path) -> None:
    before = two_nodes(tmp_path)
    empty = replace(before, allowed=replace(before.allowed, cpus=frozenset()))
    with pytest.raises(PlanError):
        replan(empty, PlanSettings())


def test_allowed_sets_compare_like_discovery(tmp_path: Path) -> None:
    topology = two_nodes(tmp_path)
    live = normalize_allowed({0, 1, 2, 3, 7}, {0, 1, 5}, topology.online, {0, 1})
    assert live == allowed_of(topology)
    assert normalize_allowed({0, 1, 2, 3}, {0, 1}, {0, 1, 2}, {0, 1}) != allowed_of(topology)
