"""The daemon as PID 1 of a real runc container with a cgroup namespace in the v2 guest:
one guest boot runs tests/vm_checks/runc_cgroupns.py (its ranks' cgroups below the
container's, `runc update` followed, `runc exec` still working, a clean stop)."""

from __future__ import annotations

import shutil

import pytest

from tests.support.vm import run_checks_in_vm

EXPECTED = (
    "runc-ns-up",
    "runc-ns-daemon-in-leaf",  # init in <ctr>/<inst>/supervisor, nothing left in <ctr>
    "runc-ns-rank-cgroups",  # each rank in its cgroup with its planned cpuset
    "runc-ns-update-followed",  # runc update --cpuset-cpus 0-1: accepted, ranks narrowed
    "runc-ns-exec-works",  # runc exec lands in the init's cgroup (the leaf)
    "runc-ns-clean-stop",  # runc kill TERM: stopped, rank cgroups removed
)


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_a_runc_container_with_a_cgroup_namespace_gets_rank_cgroups() -> None:
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed (.ci/setup installs it)")
    run_checks_in_vm("tests/vm_checks/runc_cgroupns.py", EXPECTED, timeout_s=600.0)
