"""What the host lets the supervisor bind: the real probes on this machine, and what
/readyz, /placement and the metrics make of a capability the host denies."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest

from supervisor.bind import syscalls
from supervisor.bind.capability import probe_capabilities, probe_irq, probe_mempolicy
from supervisor.bind.report import ShimReport, bound_as_planned
from supervisor.hostfs import HostFS
from supervisor.plan.placement import Slot
from supervisor.serve.documents import placement_doc, readyz_doc
from supervisor.serve.metrics import build_registry
from supervisor.state import Capability, Snapshot, StateStore
from tests.support.api_fixture import Scenario, realistic_snapshot


def in_thread(fn):  # type: ignore[no-untyped-def]
    """Run `fn` on a fresh thread (a memory policy is per thread) and return its result."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_the_mempolicy_probe_binds_for_real_and_puts_the_old_policy_back() -> None:
    def probe() -> tuple[object, tuple[int, frozenset[int]]]:
        syscalls.set_mempolicy(syscalls.MPOL_PREFERRED, [0])
        cap = probe_mempolicy([0])
        return cap, syscalls.get_mempolicy()

    cap, after = in_thread(probe)
    assert cap == Capability("mempolicy", True)
    assert after == (syscalls.MPOL_PREFERRED, frozenset({0}))


def test_the_mempolicy_probe_says_why_it_fails() -> None:
    cap = in_thread(lambda: probe_mempolicy([1023]))  # a node nobody has: EINVAL
    assert not cap.available and cap.missing
    assert "set_mempolicy bind" in (cap.reason or "") and "EINVAL" in (cap.reason or "")


def test_the_irq_probe_writes_the_value_back_and_reports_a_missing_proc_irq(
    tmp_path: Path,
) -> None:
    before = Path("/proc/irq/default_smp_affinity").read_text()
    assert probe_irq(HostFS("/")).available
    assert Path("/proc/irq/default_smp_affinity").read_text() == before
    cap = probe_irq(HostFS(str(tmp_path)))
    assert not cap.available and "default_smp_affinity" in (cap.reason or "")


def test_probe_capabilities_keeps_what_is_not_wanted_apart() -> None:
    cgroup = Capability("cgroup", False, wanted=False, reason='cgroup = "off"')
    caps = in_thread(lambda: probe_capabilities(HostFS("/"), [0], cgroup=cgroup, irq_wanted=False))
    assert caps["mempolicy"].available
    assert not caps["irq"].missing and not caps["cgroup"].missing


def _denied(snap: Snapshot) -> Snapshot:
    """`snap` on a host whose seccomp filter fails set_mempolicy: every process got
    its CPUs and no memory policy, its `bound` as the runner computes it."""
    caps = {
        "mempolicy": Capability("mempolicy", False, reason="set_mempolicy bind nodes 0: EPERM"),
        "cgroup": Capability("cgroup", False, reason="no writable cgroup subtree: read-only"),
        "irq": Capability("irq", False, reason="/proc/irq/default_smp_affinity: Read-only"),
    }
    procs = {}
    for key, status in snap.processes.items():
        slot = (
            snap.placement.engine
            if key == "engine" and snap.placement.engine is not None
            else next(r.slot for r in snap.placement.ranks if r.rank == key)
        )
        report = ShimReport(cpus=tuple(sorted(slot.cpus)), mems=(), mempolicy="none")
        bound = bound_as_planned(report, slot, mempolicy_allowed=False)
        procs[key] = replace(
            status, mempolicy="none", mempolicy_reason="EPERM", bound=bound, cpus_bound=True
        )
    return replace(snap, processes=MappingProxyType(procs), capabilities=MappingProxyType(caps))


def test_ready_when_bound_as_far_as_the_host_allows() -> None:
    slot = Slot(cpus=(2, 3), mems=(0,))
    report = ShimReport(cpus=(2, 3), mems=(), mempolicy="none")
    assert not bound_as_planned(report, slot)  # where the host allows a policy
    assert bound_as_planned(report, slot, mempolicy_allowed=False)
    wrong_cpus = replace(report, cpus=(2,))
    assert not bound_as_planned(wrong_cpus, slot, mempolicy_allowed=False)

    snap = _denied(realistic_snapshot(Scenario(drifted_rank=None)))
    assert snap.ready
    ready = readyz_doc(snap)
    assert (ready["status"], ready["ready"]) == (200, True)
    assert {p["state"] for p in ready["processes"]} == {"running"}
    doc = placement_doc(snap)
    caps = doc["supervisor"]["capabilities"]
    assert caps["mempolicy"] == {
        "available": False,
        "wanted": True,
        "reason": "set_mempolicy bind nodes 0: EPERM",
    }
    rank0 = doc["ranks"][0]
    assert rank0["bound"] and rank0["cpus_bound"]
    targets = {n["target"]: n for n in rank0["not_bound"]}
    assert targets["memory"] == {
        "target": "memory",
        "reason": "set_mempolicy bind nodes 0: EPERM",
        "allowed": False,
    }
    assert targets["cgroup"]["allowed"] is False
    assert doc["engine"]["not_bound"] and "irqs" not in {
        n["target"] for n in doc["engine"]["not_bound"]
    }


def test_a_denied_capability_is_a_gauge_not_a_readiness_failure() -> None:
    snap = _denied(realistic_snapshot(Scenario(drifted_rank=None)))
    registry = build_registry(StateStore(snap))
    for name in ("mempolicy", "cgroup", "irq"):
        assert registry.get_sample_value("placement_capability", {"name": name}) == 0.0
        assert registry.get_sample_value("placement_capability_wanted", {"name": name}) == 1.0
    assert registry.get_sample_value("placement_ready") == 1.0
    allowed = replace(
        snap,
        capabilities=MappingProxyType({"mempolicy": Capability("mempolicy", True)}),
    )
    registry = build_registry(StateStore(allowed))
    assert registry.get_sample_value("placement_capability", {"name": "mempolicy"}) == 1.0


def _without_irqs(snap: Snapshot) -> Snapshot:
    """`snap` with a plan that has no IRQ to bind: [irq] enabled (its default), but no
    device of the plan has an IRQ (a container that sees no device IRQ)."""
    ranks = tuple(replace(r, irqs=()) for r in snap.placement.ranks)
    return replace(snap, placement=replace(snap.placement, ranks=ranks))


def test_irq_binding_is_wanted_only_when_the_plan_has_irqs_to_bind() -> None:
    denied = _denied(realistic_snapshot(Scenario(drifted_rank=None)))
    assert denied.placement.has_irqs and denied.capabilities["irq"].wanted
    no_irqs = _without_irqs(denied)
    registry = build_registry(StateStore(no_irqs))
    # What PlacementCapabilityMissing{name="irq"} reads: wanted 0, so it cannot fire.
    assert registry.get_sample_value("placement_capability_wanted", {"name": "irq"}) == 0.0
    assert registry.get_sample_value("placement_capability", {"name": "irq"}) == 0.0
    irq = placement_doc(no_irqs)["supervisor"]["capabilities"]["irq"]
    assert irq == {
        "available": False,
        "wanted": False,
        "reason": "/proc/irq/default_smp_affinity: Read-only",
    }
    # The same host with IRQs in the plan: wanted, and missing.
    registry = build_registry(StateStore(denied))
    assert registry.get_sample_value("placement_capability_wanted", {"name": "irq"}) == 1.0
    assert placement_doc(denied)["supervisor"]["capabilities"]["irq"]["wanted"] is True


def test_the_start_says_irq_missing_only_when_the_plan_has_irqs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cgroup = Capability("cgroup", True)
    empty = HostFS(str(tmp_path))  # no /proc/irq: what a container without it sees
    with caplog.at_level("INFO", logger="placement_supervisor"):
        caps = in_thread(
            lambda: probe_capabilities(
                empty, [0], cgroup=cgroup, irq_wanted=True, irqs_planned=False
            )
        )
    assert not caps["irq"].available
    lines = [r.getMessage() for r in caplog.records if "name=irq" in r.getMessage()]
    assert len(lines) == 1 and "capability missing" not in lines[0], lines
    assert 'wanted="no IRQ in the plan"' in lines[0], lines
    caplog.clear()
    with caplog.at_level("INFO", logger="placement_supervisor"):
        in_thread(
            lambda: probe_capabilities(
                empty, [0], cgroup=cgroup, irq_wanted=True, irqs_planned=True
            )
        )
    assert any("capability missing name=irq" in r.getMessage() for r in caplog.records)
