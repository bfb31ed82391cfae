"""The check loop in a real 2-node kernel with cgroup v2: one guest boot runs
tests/vm_checks/checker_numa.py (cpuset change -> ranks move; remote pages -> migrated)."""

from __future__ import annotations

import pytest

from tests.vm import PYTHON, run_in_vm

EXPECTED = (
    "cpuset-v2-ranks-move",  # cpuset.cpus 2-3: every thread of every rank within 2-3
    "cpuset-v2-rank-cgroups",  # the per-rank v2 cgroups follow the new plan
    "cpuset-v2-counted",
    "cpuset-v2-grow-back",  # 0-3 again: rank 0 back on node 0's CPUs
    "cpuset-v2-no-restart",  # re-bound in place, never restarted
    "memory-ratio-reported-low",  # 64 MiB allocated on node 0 before binding: ratio < 0.5
    "memory-migrated",  # memory_locality = "enforce": ratio >= 0.99, from numa_maps too
    "memory-rebind-event",
    "cpuset-clean-stop",
    "memory-clean-stop",
)


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_check_loop_in_a_two_node_guest() -> None:
    done = run_in_vm(
        ["--nodes", "2"], [PYTHON, "-u", "tests/vm_checks/checker_numa.py"], timeout_s=600
    )
    status = {
        line.split()[1].rstrip(":"): line.split()[0]
        for line in done.stdout.splitlines()
        if line.startswith(("PASS ", "FAIL "))
    }
    for name in EXPECTED:
        assert status.get(name) == "PASS", (
            f"{name}: {status.get(name)}\n{done.stdout}\n{done.stderr}"
        )
    assert done.returncode == 0, done.stdout + done.stderr
