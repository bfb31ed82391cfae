"""The daemon in a real 2-node NUMA kernel: one guest boot runs tests/vm_checks/daemon_numa.py.

The demo config on the default guest (node 0 = CPUs 0-1, node 1 = CPUs 2-3)
plans one rank per node; the worker planned on node 1 must have every
anonymous page on node 1, bound from birth by the shim.
"""

from __future__ import annotations

import pytest

from tests.support.vm import run_checks_in_vm

EXPECTED = (
    "daemon up",
    "one rank per node",
    "planned on node 1",
    "shim bound memory",
    "worker affinity",
    "worker memory grew",
    "anonymous memory on node 1 only",
    "policy bind:1",
    "the node-0 rank stays on node 0",
    "clean stop",
    "no process left",
)


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_demo_worker_on_node_1_keeps_all_anonymous_memory_on_node_1() -> None:
    run_checks_in_vm("tests/vm_checks/daemon_numa.py", EXPECTED)
