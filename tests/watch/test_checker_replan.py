"""supervisor.plan.replan on fixture hosts: the degrade ladder, fixed ranks, what moved (pure),
and the re-read a re-plan does (topology.discover.reread_cpus)."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.cpulist import parse_cpulist
from supervisor.errors import PlanError
from supervisor.examples.builder import FakeHost
from supervisor.examples.hosts import dgx_h100
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
from supervisor.topology.discover import read_topology, reread_cpus
from supervisor.topology.model import DiscoveryOptions, Topology


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


def test_a_replan_rereads_only_cpus_nodes_and_the_allowed_set(tmp_path: Path) -> None:
    root = dgx_h100(tmp_path)
    fs = HostFS(str(root))
    before = read_topology(fs, DiscoveryOptions())
    assert before.devices and before.nics and before.irqs
    # What a cpuset write or a hotplug cannot change goes away: re-reading any
    # of it would now fail (or find nothing).
    for rel in ("sys/bus/pci", "sys/class/net", "sys/class/infiniband"):
        shutil.rmtree(root / rel, ignore_errors=True)
    (root / "proc/interrupts").unlink()
    status = root / "proc/self/status"
    node1 = "56-111,168-223"
    status.write_text(
        re.sub(r"Cpus_allowed_list:\t.*", f"Cpus_allowed_list:\t{node1}", status.read_text())
    )
    after = reread_cpus(fs, before)
    assert after.allowed.cpus == parse_cpulist(node1)
    assert (after.devices, after.nics, after.irqs) == (before.devices, before.nics, before.irqs)
    result = replan(after, PlanSettings(rank_roles={}, engine=False))
    assert {c for r in result.placement.ranks for c in r.slot.cpus} <= parse_cpulist(node1)
    assert len(result.placement.ranks) == 8  # the same ranks, moved
