"""An adopted worker in a real 2-node NUMA kernel: tests/vm_checks/adopt_numa.py in one guest boot.

The engine sits on node 0 under MPOL_BIND (its workers inherit that policy);
the worker it spawns for the rank planned on node 1 touches 64 MiB there,
is then named (setproctitle) and adopted into that rank's cgroup, and must
end with at least 99% of its anonymous pages on node 1.
"""

from __future__ import annotations

import pytest

from tests.support.vm import run_checks_in_vm

EXPECTED = (
    "pages on node 0 before adoption",
    "adopted",
    "one rank per node",
    "planned on node 1",
    "engine on node 0",
    "same worker adopted",
    "local memory ratio >= 0.99",
    "worker affinity",
    "no bind failure",  # adopting must not log a spurious EINVAL for the engine
    "clean stop",
    "no process left",
)


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_an_adopted_worker_on_node_1_keeps_its_memory_on_node_1() -> None:
    run_checks_in_vm("tests/vm_checks/adopt_numa.py", EXPECTED)
