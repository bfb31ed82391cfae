"""A process's own cgroup changed by someone else, as tables: decide and settle (pure).

Each row is one `CgroupObservation` (a dir removed, a cpuset rewritten
narrower, wider or elsewhere, the process moved out) under `enforce`,
`observe` and the API; it fails when the finding is missed, counted twice,
repaired under observe or left alone under enforce.
"""

from __future__ import annotations

import errno
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest

from supervisor.config import DriftConfig
from supervisor.errors import translate_oserror
from supervisor.plan.placement import Slot
from supervisor.procfs.identity import ThreadId
from supervisor.state import CgroupObservation, Observation, ThreadObservation
from supervisor.watch.decide import CgroupRepair, RepairState, Seen, decide
from supervisor.watch.policy import Policy
from supervisor.watch.settle import Outcome, Outcomes, settle

SLOT = Slot((2, 3), (1,), {"main": (2, 3)})
NOW = 1000.0
PID = 4242
MAIN = ThreadObservation(PID, "main", "main", (2, 3), id=ThreadId(PID, 1))
MEMBER = ThreadObservation(4300, "child", "main", (2, 3), id=ThreadId(4300, 2), pid=4300)
AS_MADE = CgroupObservation((), (2, 3), (1,), False)


def policy(action: str, cause: str = "check") -> Policy:
    drift = DriftConfig(policy=MappingProxyType({"cgroup": action}))  # type: ignore[dict-item]
    return Policy.of(drift, cause)  # type: ignore[arg-type]


def run(cg: CgroupObservation | None, pol: Policy, state: RepairState | None = None) -> Any:
    obs = Observation((MAIN, MEMBER), cgroup=cg)
    return decide(SLOT, Seen(0, PID, obs, True), state or RepairState(), pol, NOW)


REMOVED = CgroupObservation(("/sys/fs/cgroup/memory/x/placement-supervisor/rank0",))
ROWS = [
    # name, observation, the findings' targets
    ("as made", AS_MADE, []),
    ("no cgroup", None, []),
    ("removed", REMOVED, ["cgroup"]),
    ("cpus elsewhere", replace(AS_MADE, cpus=(0,)), ["cgroup cpuset.cpus"]),
    ("cpus narrowed", replace(AS_MADE, cpus=(3,)), ["cgroup cpuset.cpus"]),
    ("cpus widened", replace(AS_MADE, cpus=(0, 1, 2, 3)), ["cgroup cpuset.cpus"]),
    ("mems", replace(AS_MADE, mems=(0, 1)), ["cgroup cpuset.mems"]),
    ("moved out", replace(AS_MADE, outside=True), ["cgroup.procs"]),
    # v1: no per-process cpuset, only a memory cgroup
    ("v1 as made", CgroupObservation(), []),
    ("v1 moved out", CgroupObservation(outside=True), ["cgroup.procs"]),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_cgroup_rows(row: tuple[Any, ...]) -> None:
    _, cg, targets = row
    enforced = run(cg, policy("enforce"))
    assert [f.target for f in enforced.findings] == targets
    assert all(f.kind == "cgroup" for f in enforced.findings)
    assert [f.target for f in enforced.new_drift] == targets  # counted when it appears
    if targets:
        # Re-made with the slot's CPUs and nodes, the process and its tree's members back in.
        assert enforced.cgroup == CgroupRepair((2, 3), (1,), (PID, 4300), "cgroup")
    else:
        assert enforced.cgroup is None
    observed = run(cg, policy("observe"))
    assert [f.target for f in observed.new_drift] == targets  # reported ...
    assert [f.action for f in observed.findings] == ["observe"] * len(targets)
    assert observed.cgroup is None  # ... and left alone
    api = run(cg, policy("observe", "api"))
    assert (api.cgroup is not None) == bool(targets)
    if api.cgroup is not None:
        assert api.cgroup.reason == "api"


def test_a_lasting_change_is_counted_once() -> None:
    first = run(REMOVED, policy("observe"))
    again = run(REMOVED, policy("observe"), first.state)
    assert len(first.new_drift) == 1 and again.new_drift == ()
    back = run(AS_MADE, policy("observe"), again.state)
    assert back.findings == ()
    assert len(run(REMOVED, policy("observe"), back.state).new_drift) == 1  # came back: again


def test_a_new_plan_leaves_the_cgroup_to_the_next_pass() -> None:
    d = run(REMOVED, policy("enforce", "cpuset_changed"))
    assert d.cgroup is None and d.new_drift == ()


def test_settle_fixes_or_fails_the_repair() -> None:
    d = run(replace(AS_MADE, cpus=(0,)), policy("enforce"))
    fixed = settle(d, Outcomes(cgroup=Outcome()), policy("enforce"), NOW)
    assert fixed.remaining == () and "cgroup cpuset.cpus" in fixed.fixed
    err = translate_oserror("cpuset.cpus", OSError(errno.EINVAL, "Invalid argument"))
    failed = settle(d, Outcomes(cgroup=Outcome(error=err)), policy("enforce"), NOW)
    assert [f.action for f in failed.remaining] == ["failed"]
    assert [(f.target, f.reason) for f in failed.failures] == [("cgroup", "invalid")]
    # The same failure next pass is not new; a success clears it.
    again = replace(d, state=failed.state)
    assert settle(again, Outcomes(cgroup=Outcome(error=err)), policy("enforce"), NOW).failures == ()
    assert settle(again, Outcomes(cgroup=Outcome()), policy("enforce"), NOW).state.failures == {}
