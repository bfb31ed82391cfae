"""supervisor.in_force: the one holder of the plan in force, and what an install
moved (pure; fixture hosts)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.config import Config, ProcessConfig
from supervisor.errors import PlanError
from supervisor.examples.builder import FakeHost
from supervisor.examples.hosts import dgx_h100
from supervisor.hostfs import HostFS
from supervisor.in_force import PlanInForce, irq_changed_keys
from supervisor.plan.placement import PlanSettings
from supervisor.plan.planner import plan
from supervisor.plan.replan import merge_topology, replan
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions, Topology

CONFIG = Config(None, None, ProcessConfig(("worker",)))
SETTINGS = PlanSettings(rank_roles={}, engine=False, on_shortage="error")


def two_nodes(tmp_path: Path, name: str, allowed: str | None = None) -> Topology:
    host = FakeHost(tmp_path / name).cpus(2, 2, 1)
    if allowed is not None:
        host.allowed(allowed, "0-1")
    return read_topology(HostFS(str(host.build())), DiscoveryOptions(cpu_ranks=2))


def test_install_replaces_the_plan_and_says_what_moved(tmp_path: Path) -> None:
    before = two_nodes(tmp_path, "before")
    old = replan(before, SETTINGS).placement
    held = PlanInForce(CONFIG, before, old)
    assert held.slot(0).cpus == old.rank(0).slot.cpus and held.generation == 0
    after = merge_topology(two_nodes(tmp_path, "after", allowed="2-3"), before)
    new = replan(after, SETTINGS).placement
    moved = held.install(new, after)
    assert moved.keys == (0, 1)
    assert moved.slot(0, old=True) == old.rank(0).slot and moved.slot(0) == new.rank(0).slot
    assert not moved.config_changed and moved.cgroup_failed == {}
    assert held.placement is new and held.topology is after and held.config is CONFIG
    assert held.slot(0).cpus == (2,) and held.generation == 1
    # The same plan again moves nothing; a new config is said so and kept.
    other = replace(CONFIG, stop_timeout_s=3.0)
    again = held.install(new, after, config=other)
    assert again.keys == () and again.config_changed and held.config is other


def test_a_plan_of_other_processes_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    before = two_nodes(tmp_path, "before")
    old = replan(before, SETTINGS).placement
    held = PlanInForce(CONFIG, before, old)
    fewer = replace(old, ranks=old.ranks[:1])
    with pytest.raises(PlanError, match=r"other processes \(0\) than the plan in force \(0, 1\)"):
        held.install(fewer, before)
    assert held.placement is old and held.generation == 0


def test_irq_changes_are_named_by_rank(tmp_path: Path) -> None:
    topology = read_topology(HostFS(str(dgx_h100(tmp_path))))
    full = plan(topology, PlanSettings(irq_nic=True))
    rank = full.rank(3)
    fewer = replace(
        full,
        ranks=tuple(replace(r, irqs=r.irqs[1:]) if r is rank else r for r in full.ranks),
    )
    assert irq_changed_keys(full, full) == ()
    assert irq_changed_keys(full, fewer) == (3,)
    moved = PlanInForce(CONFIG, topology, full).install(fewer, topology)
    assert moved.keys == () and moved.irq_keys == (3,)
