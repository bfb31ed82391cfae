"""The check loop in a real 2-node kernel with cgroup v2: one guest boot runs
tests/vm_checks/checker_numa.py (cpuset change -> ranks move; remote pages -> migrated)."""

from __future__ import annotations

import pytest

from tests.support.vm import run_checks_in_vm

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
    run_checks_in_vm("tests/vm_checks/checker_numa.py", EXPECTED)


HOTPLUG_EXPECTED = (
    "hotplug-daemon-up",
    "hotplug-start-plan",
    "hotplug-offline-replans",  # cpu3 offline: rank 1 re-planned and re-bound onto CPU 2
    "hotplug-rank0-untouched",
    "hotplug-counted",
    "hotplug-online-restores",  # cpu3 back: rank 1 on 2-3 again
    "hotplug-no-restart",
    "hotplug-clean-stop",
)


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_cpu_hotplug_in_a_two_node_guest() -> None:
    run_checks_in_vm("tests/vm_checks/checker_hotplug.py", HOTPLUG_EXPECTED)
