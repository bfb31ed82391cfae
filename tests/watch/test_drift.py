"""supervisor.watch.drift: pure findings for every kind, and a real thread pushed off its CPUs."""

from __future__ import annotations

import os
from types import MappingProxyType

import pytest

from supervisor.config import DriftConfig
from supervisor.cpulist import format_cpulist
from supervisor.hostfs import HostFS
from supervisor.plan.keys import ThreadRole
from supervisor.plan.placement import Slot
from supervisor.state import Finding, IrqObservation, Observation, ThreadObservation
from supervisor.watch.drift import apply_policy, diff, irq_drifted, target_id
from supervisor.watch.observe import ThreadScanner, observe_process
from supervisor.watch.policy import Policy
from tests.support.children import ThreadedChild

SLOT = Slot(
    cpus=tuple(range(8)),
    mems=(0,),
    roles={"irq": (0, 1), "main": (2, 3, 4, 5), "acl": (6,), "release": (7,)},
)


def _obs(
    *threads: ThreadObservation, ratio: float | None = None, irqs: tuple[IrqObservation, ...] = ()
) -> Observation:
    memory = {} if ratio is None else {0: int(ratio * 1000), 1: 1000 - int(ratio * 1000)}
    return Observation(tuple(threads), MappingProxyType(memory), ratio, irqs, 1.0)


def test_clean_observation_has_no_findings() -> None:
    obs = _obs(
        ThreadObservation(10, "python3", "main", (2, 3, 4, 5)),
        ThreadObservation(11, "acl_thread", "acl", (6,)),
        ratio=0.95,
        irqs=(IrqObservation(41, (0,), (0, 1)),),
    )
    assert diff(SLOT, obs, threshold=0.9) == ()
    assert diff(SLOT, None, threshold=0.9) == ()


def test_thread_affinity() -> None:
    obs = _obs(
        ThreadObservation(10, "python3", "main", tuple(range(8))),  # the shim's whole slot
        ThreadObservation(11, "acl_thread", "acl", (2, 3, 4, 5)),
        ThreadObservation(12, "python3", "main", (3,)),  # pinned by the workload
        ThreadObservation(13, "hccl", "comm", (0, 1)),  # role merged into main
    )
    findings = diff(SLOT, obs, threshold=0.9)
    assert findings == (
        Finding("thread_affinity", "tid 10", "2-5", "0-7"),
        Finding("thread_affinity", "tid 11", "6", "2-5"),
        Finding("thread_affinity", "tid 13", "2-5", "0-1"),
    )
    strict = diff(SLOT, obs, threshold=0.9, pinned_ok=False)
    assert [target_id(f) for f in strict] == [10, 11, 12, 13]


def test_memory_locality() -> None:
    (finding,) = diff(SLOT, _obs(ratio=0.72), threshold=0.9)
    assert finding.kind == "memory_locality"
    assert finding.target == "memory"
    assert "0.720" in finding.actual and "node0=" in finding.actual
    assert diff(SLOT, _obs(ratio=0.9), threshold=0.9) == ()
    assert diff(SLOT, _obs(ratio=None), threshold=0.9) == ()  # nothing resident yet
    assert target_id(finding) is None


def test_irq_affinity() -> None:
    irqs = (
        IrqObservation(41, (0,), (0, 1)),  # effective inside the planned set
        IrqObservation(42, (5,), (0, 1)),  # moved (irqbalance)
        IrqObservation(43, (), (0, 1)),  # gone: skipped
        IrqObservation(44, (1, 2), (0, 1)),  # partly outside
    )
    findings = diff(SLOT, _obs(irqs=irqs), threshold=0.9)
    assert findings == (
        Finding("irq_affinity", "irq 42", "0-1", "5"),
        Finding("irq_affinity", "irq 44", "0-1", "1-2"),
    )
    assert [target_id(f) for f in findings] == [42, 44]


def test_process_gone_hides_everything_else() -> None:
    obs = _obs(ThreadObservation(10, "python3", "main", (9,)), ratio=0.1)
    assert diff(SLOT, obs, threshold=0.9, process_alive=False) == (
        Finding("process_gone", "process", "running", "exited"),
    )


def test_irq_drifted_is_the_one_rule() -> None:
    assert irq_drifted((5,), (2,))
    assert not irq_drifted((2,), (2, 3))  # narrowed within its CPUs
    assert not irq_drifted((), (2,))  # gone
    assert not irq_drifted((5,), ())  # not ours to keep


def test_apply_policy() -> None:
    findings = (
        Finding("thread_affinity", "tid 1", "2-5", "0-7"),
        Finding("memory_locality", "memory", ">=0.90", "0.5"),
        Finding("irq_affinity", "irq 4", "0", "3"),
        Finding("process_gone", "process", "running", "exited"),
    )
    policy = Policy.of(DriftConfig())
    kinds = [f.kind for f in findings]
    # memory_locality "auto": observed for a process bound from birth, enforced otherwise.
    applied = apply_policy(findings, {k: policy.action(k, bound_from_birth=True) for k in kinds})
    assert [f.action for f in applied] == ["enforce", "observe", "enforce", "observe"]
    adopted = apply_policy(findings, {k: policy.action(k, bound_from_birth=False) for k in kinds})
    assert [f.action for f in adopted] == ["enforce", "enforce", "enforce", "observe"]
    assert [f.action for f in apply_policy(findings, {})] == ["observe"] * 4
    assert apply_policy(applied, {"memory_locality": "enforce"})[1].action == "enforce"


def test_real_thread_pushed_off_and_fixed() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 allowed CPUs to push a thread off its role")
    fs = HostFS("/")
    slot = Slot(tuple(allowed), (0,), {"main": tuple(allowed[:-1]), "acl": tuple(allowed[-1:])})
    roles = (ThreadRole("acl", "workers", "acl_thread"),)
    with ThreadedChild(["acl_thread", "worker-0", "worker-1"]) as child:
        scanner = ThreadScanner(fs, child.pid)
        # Put every thread where the plan wants it (what the binder would do).
        tids = [t.tid for t in scanner.scan()]
        acl = child.threads["acl_thread"]
        for tid in tids:
            os.sched_setaffinity(tid, slot.role_cpus("acl" if tid == acl else "main"))

        def check() -> tuple[Finding, ...]:
            obs = observe_process(fs, child.pid, slot, "workers", roles=roles, scanner=scanner)
            return diff(slot, obs, threshold=0.9)

        assert check() == ()
        victim = child.threads["worker-1"]
        os.sched_setaffinity(victim, allowed[-1:])  # onto the acl CPU
        findings = check()
        assert findings == (
            Finding(
                "thread_affinity",
                f"tid {victim}",
                format_cpulist(allowed[:-1]),
                str(allowed[-1]),
            ),
        )
        assert target_id(findings[0]) == victim
        os.sched_setaffinity(victim, slot.role_cpus("main"))
        assert check() == ()
