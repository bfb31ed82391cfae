"""The daemon as a container's entrypoint under a cgroup namespace, in a real 2-node
kernel with cgroup v2: one guest boot runs tests/vm_checks/cgroupns_delegation.py
(a delegated container cgroup is used through a leaf and never has its own files
written; cpuset not delegated or a read-only cgroupfs: said once, no child
cgroups, ready)."""

from __future__ import annotations

import pytest

from tests.support.vm import run_checks_in_vm

EXPECTED = (
    "ns-daemon-up",
    "ns-ready",
    "ns-everyone-in-leaf",  # the daemon and the container's other process: <ctr>/<inst>/supervisor
    "ns-rank-cgroups",  # each rank in <ctr>/<inst>/rank<N> with its planned cpuset
    "ns-follows-runtime",  # the runtime's cpuset write is followed, never refused
    "ns-clean-stop",
    "ns-own-files-untouched",  # of /ctr only cgroup.subtree_control; nothing of the root
    "nocpuset-ready",
    "nocpuset-said-once",
    "nocpuset-no-child-cgroups",
    "nocpuset-capability",
    "nocpuset-clean-stop",
    "rofs-ready",
    "rofs-said-once",
    "rofs-no-child-cgroups",
    "rofs-capability",
    "rofs-clean-stop",
    "busy-ready",  # a host cgroup with another process in it: EBUSY, moved back, said once
    "busy-said-once",
    "busy-no-child-cgroups",
    "busy-capability",
    "busy-clean-stop",
)


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_a_container_s_delegated_v2_cgroup_under_a_cgroup_namespace() -> None:
    run_checks_in_vm("tests/vm_checks/cgroupns_delegation.py", EXPECTED, timeout_s=600.0)
