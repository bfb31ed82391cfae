"""Workers' memory on their ranks' nodes in every deployment mode: one guest boot per mode.

tests/vm_checks/memory_modes.py runs three daemons in each mode (spawned
workers, vLLM-style workers bound by the start-up hook, an env-rank
launcher's unhooked workers adopted late), each worker allocating at start
and for 12 s after. On main before issue 26 the `off`, `v1` and `v2-root`
rows failed: rank 1's pages stayed on the engine's node (0.00 local).
"""

from __future__ import annotations

import pytest

from tests.support.vm import run_checks_in_vm
from tests.vm_checks.memory_modes import RUNS

# mode -> run-in-vm's cgroup option
MODES = {
    "v2-delegated": "v2",
    "v2-root": "v2",
    "v1": "v1",
    "off": "v2",
    "seccomp": "v2",
}


def expected(mode: str) -> list[str]:
    names: list[str] = []
    for run in RUNS:
        names += [f"{run} running", f"{run} workers allocated", f"{run} mempolicy capability"]
        for rank, node in ((0, 0), (1, 1)):
            name = f"{run} rank {rank} on node {node}"
            local = f"{name} pages local" if mode != "seccomp" else f"{name} pages measured"
            names += [local, f"{name} cpus", f"{name} metric matches numa_maps"]
        names.append(f"{run} clean stop")
    return names


@pytest.mark.vm
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_workers_memory_is_on_its_ranks_node(mode: str) -> None:
    run_checks_in_vm(
        "tests/vm_checks/memory_modes.py",
        expected(mode),
        args=(mode,),
        vm_args=("--nodes", "2", "--cgroup", MODES[mode]),
        timeout_s=900,
    )
