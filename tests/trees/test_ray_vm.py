"""Real Ray actors ranked by the device node they hold open, in the numavm guest
(where device nodes can be made): tests/vm_checks/ray_devices.py in one boot."""

from __future__ import annotations

import pytest

from tests.support.vm import run_checks_in_vm

EXPECTED = (
    "ray start running",
    "two actors",
    "both ranks adopted",
    "ranked by the device held open",
    "rank 0 threads on its CPUs",
    "rank 1 threads on its CPUs",
    "clean stop",
    "no actor left",
)


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_ray_actors_are_ranked_by_the_device_they_opened() -> None:
    run_checks_in_vm("tests/vm_checks/ray_devices.py", EXPECTED, timeout_s=600)
