"""numa_maps of memory on another node; run INSIDE the test guest (as root).

    tests/guest/run-in-vm --nodes 2 -- \
        .venv/bin/python -u tests/vm_checks/observe_numa.py

Expects a guest with NUMA node 1 and numactl. A child touches 64 MiB under
`numactl --membind=1` while its slot plans it on node 0: supervisor.watch.observe
must see the pages on node 1, a low local ratio for the node-0 slot, and
supervisor.watch.drift one memory_locality finding. Prints "PASS name: detail" or
"FAIL name: detail" per check (tests/vm.py's Checklist) and exits 1 if any
failed; tests/watch/test_observe.py::test_numa_maps_in_vm asserts on those lines.
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from supervisor.hostfs import HostFS
from supervisor.plan.placement import Slot
from supervisor.procfs.numa_maps import read_numa_maps
from supervisor.watch.drift import diff
from supervisor.watch.observe import local_memory_ratio, observe_process
from tests.support.children import ThreadedChild
from tests.support.vm import Checklist

MIB = 1 << 20
LIVE = HostFS("/")
CHECKS = Checklist()


@CHECKS.guarded("numa-maps-remote-child")
def remote_child() -> None:
    numactl = shutil.which("numactl")
    has_node1 = os.path.isdir("/sys/devices/system/node/node1")
    if not CHECKS.check(
        "node1-and-numactl", has_node1 and numactl is not None, f"node1={has_node1} {numactl=}"
    ):
        return
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    slot = Slot(cpus, (0,), {"main": cpus})  # planned on node 0, memory bound to node 1
    with ThreadedChild([], touch_bytes=64 * MIB, wrapper=["numactl", "--membind=1"]) as remote:
        by_node = read_numa_maps(LIVE, remote.pid)
        obs = observe_process(LIVE, remote.pid, slot, "workers", numa_maps=True)
    CHECKS.check(
        "numa-maps-pages-on-node1", by_node.get(1, 0) >= 64 * MIB, f"bytes by node {by_node}"
    )
    ratio = local_memory_ratio(by_node, [1])
    CHECKS.check("ratio-local-to-node1", ratio is not None and ratio > 0.5, f"ratio {ratio}")
    observed = obs.local_memory_ratio
    CHECKS.check(
        "observed-ratio-low", observed is not None and observed < 0.5, f"observed ratio {observed}"
    )
    findings = diff(slot, obs, threshold=0.9)
    CHECKS.check(
        "memory-locality-finding",
        len(findings) == 1 and findings[0].kind == "memory_locality",
        f"findings {findings}",
    )


def main() -> int:
    remote_child()
    return CHECKS.exit_code()


if __name__ == "__main__":
    sys.exit(main())
