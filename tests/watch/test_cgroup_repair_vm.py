"""Rank cgroups changed by someone else in a real 2-node kernel with cgroup v2: one
guest boot runs tests/vm_checks/cgroup_repair.py (cpuset rewritten -> put back,
dir removed -> re-made and the worker back in)."""

from __future__ import annotations

import pytest

from tests.support.vm import run_checks_in_vm

EXPECTED = (
    "repair-daemon-up",
    "repair-start-plan",
    "repair-v2-cpus-elsewhere",  # rank 0's cpuset.cpus = 2: back to 0-1, threads too
    "repair-v2-counted",  # drift_events{kind="cgroup"} once
    "repair-v2-cpus-widened",  # 0-3: back to 0-1, counted again
    "repair-v2-mems",  # rank 1's cpuset.mems = 0-1: back to 1
    "repair-v2-removed",
    "repair-v2-remade",  # rank 1's dir re-made, its cpuset set, the worker back in
    "repair-v2-no-restart",
    "repair-clean-stop",
)


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_rank_cgroups_changed_by_others_are_put_back_in_a_v2_guest() -> None:
    run_checks_in_vm("tests/vm_checks/cgroup_repair.py", EXPECTED)
