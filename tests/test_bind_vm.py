"""Binding in a real 2-node NUMA kernel: one guest boot runs tests/vm_checks/bind_checks.py."""

from __future__ import annotations

import pytest

from tests.vm import PYTHON, run_in_vm

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
    done = run_in_vm(
        ["--nodes", "2"], [PYTHON, "-u", "tests/vm_checks/bind_checks.py"], timeout_s=600
    )
    lines = done.stdout.splitlines()
    status = {
        line.split()[1].rstrip(":"): line.split()[0]
        for line in lines
        if line.startswith(("PASS ", "FAIL "))
    }
    for name in EXPECTED:
        assert status.get(name) == "PASS", (
            f"{name}: {status.get(name)}\n{done.stdout}\n{done.stderr}"
        )
    assert done.returncode == 0, done.stdout + done.stderr
