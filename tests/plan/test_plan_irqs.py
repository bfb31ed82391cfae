"""The IRQ plan is part of the Placement: `plan()` puts each rank's IRQs on it,
a re-plan after a cpuset change does the same, and `[irq] enabled = false`
plans none (fixture hosts; pairing rules are in tests/watch/test_irqs.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor import cli
from supervisor.cpulist import format_cpulist
from supervisor.examples.hosts import dgx_h100
from supervisor.hostfs import HostFS
from supervisor.plan.irqs import nic_functions, plan_irqs
from supervisor.plan.placement import Placement, PlanSettings
from supervisor.plan.planner import plan
from supervisor.plan.replan import replan
from supervisor.topology.discover import read_topology
from supervisor.topology.model import Topology
from tests.support.plan_invariants import check_placement


def _dgx(tmp_path: Path) -> Topology:
    return read_topology(HostFS(str(dgx_h100(tmp_path))))


def _irq_cpus(placement: Placement, rank: int) -> tuple[int, ...]:
    return tuple(sorted(placement.rank(rank).slot.role_cpus("irq")))


def test_plan_puts_each_gpu_s_irqs_on_its_rank(tmp_path: Path) -> None:
    topology = _dgx(tmp_path)
    placement = plan(topology, PlanSettings())
    check_placement(topology, placement)
    by_bdf = {d.bdf: d for d in topology.devices}
    for rank in placement.ranks:
        gpu = by_bdf[rank.device.bus_id]
        assert gpu.irqs, "the fixture GPU has no IRQs: nothing to test"
        assert [a.irq for a in rank.irqs] == sorted(gpu.irqs)
        assert {(a.source, a.owner, a.bdf) for a in rank.irqs} == {("device", gpu.label, gpu.bdf)}
        assert {a.cpus for a in rank.irqs} == {_irq_cpus(placement, rank.rank)}
    # The same IRQs the pure planner gives for this placement, rank by rank.
    assert dict(plan_irqs(topology, placement, nic=False)) == {
        r.rank: r.irqs for r in placement.ranks
    }


def test_with_nic_each_rank_also_holds_its_paired_hca_s_irqs(tmp_path: Path) -> None:
    topology = _dgx(tmp_path)
    placement = plan(topology, PlanSettings(irq_nic=True))
    check_placement(topology, placement)
    nics = {f.bdf: f for f in nic_functions(topology.nics)}
    for rank in placement.ranks:
        (bdf,) = {a.bdf for a in rank.irqs if a.source == "nic"}
        assert bdf is not None
        assert [a.irq for a in rank.irqs if a.source == "nic"] == list(nics[bdf].irqs)
        assert nics[bdf].numa_node == rank.device.numa_node
    assert dict(plan_irqs(topology, placement, nic=True)) == {
        r.rank: r.irqs for r in placement.ranks
    }


def test_irq_binding_off_plans_no_irqs_and_the_document_lists_none(tmp_path: Path) -> None:
    topology = _dgx(tmp_path)
    on = plan(topology, PlanSettings())
    off = plan(topology, PlanSettings(irqs=False))
    assert all(r.irqs == () for r in off.ranks)
    assert all("irqs" not in r for r in off.to_doc()["ranks"])
    # Apart from the IRQs it is the same plan; the document carries them both ways.
    assert replace(on, ranks=tuple(replace(r, irqs=()) for r in on.ranks)) == off
    assert all(len(r["irqs"]) == len(on.rank(r["rank"]).irqs) for r in on.to_doc()["ranks"])
    assert Placement.from_doc(on.to_doc()) == on
    assert Placement.from_doc(off.to_doc()) == off


def test_the_config_s_irq_table_reaches_the_plan(tmp_path: Path) -> None:
    root = str(dgx_h100(tmp_path))
    workers = '[workers]\ncommand = ["w", "{rank}"]\n'
    plans: dict[str, Placement] = {}
    for name, irq in {"off": "enabled = false", "nic": "nic = true", "default": ""}.items():
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(f"{workers}[irq]\n{irq}\n")
        _, plans[name] = cli.make_plan(root, str(cfg), {})
    assert all(r.irqs == () for r in plans["off"].ranks)
    assert all({a.source for a in r.irqs} == {"device"} for r in plans["default"].ranks)
    assert all({a.source for a in r.irqs} == {"device", "nic"} for r in plans["nic"].ranks)


def test_a_replan_after_a_cpuset_change_yields_the_new_irq_plan(tmp_path: Path) -> None:
    topology = _dgx(tmp_path)
    old = plan(topology, PlanSettings())
    # The cpuset loses every rank's irq CPUs: the IRQs must follow the new irq role.
    lost = {c for r in old.ranks for c in r.slot.role_cpus("irq")}
    allowed = replace(topology.allowed, cpus=topology.allowed.cpus - lost)
    new = replan(replace(topology, allowed=allowed), PlanSettings()).placement
    check_placement(replace(topology, allowed=allowed), new)
    for rank in new.ranks:
        assert [a.irq for a in rank.irqs] == [a.irq for a in old.rank(rank.rank).irqs]
        assert {a.cpus for a in rank.irqs} == {_irq_cpus(new, rank.rank)}
        assert not set(_irq_cpus(new, rank.rank)) & lost


def test_plan_table_lists_each_rank_s_irqs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--example", "dgx-h100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[1].split()
    assert header[-1] == "irqs", lines[1]
    placement = Placement.from_doc(json.loads(_plan_json(capsys)))
    for rank in placement.ranks:
        (row,) = [line.split() for line in lines[2:] if line.split()[0] == str(rank.rank)]
        assert rank.irqs and row[-1] == format_cpulist(a.irq for a in rank.irqs), row
    (engine,) = [line.split() for line in lines[2:] if line.startswith("engine")]
    assert engine[-1] == "-"


def _plan_json(capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["plan", "--example", "dgx-h100", "--json"]) == 0
    return capsys.readouterr().out
