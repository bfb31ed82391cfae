"""Ranks named by the device node each process holds open, in the numavm guest
(where device nodes can be made): tests/vm_checks/ray_devices.py in one boot.
A Ray-shaped stand-in's actors are ranked by their device; a vLLM stand-in whose
workers' devices disagree with their titles is ranked by device, with one
rank_conflict event each. Real Ray ranked by device runs on the host, in a
private /dev: tests/trees/test_ray_devices.py."""

from __future__ import annotations

import pytest

from tests.support.vm import run_checks_in_vm

EXPECTED = tuple(
    f"{case} {check}"
    for case in ("ray", "vllm")
    for check in (
        "both ranks adopted",
        "ranked by the device held open",
        "rank 0 threads on its CPUs",
        "rank 1 threads on its CPUs",
        "conflicts reported",
        "clean stop",
        "no process left",
    )
)


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_processes_are_ranked_by_the_device_they_hold_open() -> None:
    run_checks_in_vm("tests/vm_checks/ray_devices.py", EXPECTED, timeout_s=600)
