"""Binding in a real 2-node NUMA kernel: one guest boot runs tests/vm_checks/bind_checks.py."""

from __future__ import annotations

import pytest

from tests.support.vm import run_checks_in_vm

EXPECTED = (
    "shim-worker-on-node1",  # worker on node 1 through the shim: all anon pages on N1
    "migrate-pages-other-process",  # migrate_pages of another process, ratio >= 0.99
    "cgroup-v2-rank",  # per-rank v2 cgroup with cpuset: child confined, numa_stat on N1
    "cgroup-v2-update-migrates",  # cpuset.mems 1 -> 0 moves the pages (v2)
    "cgroup-v2-remove",
    "mempolicy-ladder",  # BIND outside Mems_allowed: EINVAL, falls back, still execs
)


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_binding_in_a_two_node_guest() -> None:
    run_checks_in_vm("tests/vm_checks/bind_checks.py", EXPECTED)
