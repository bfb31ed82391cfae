"""IRQ keeping in a real 2-node kernel: one guest boot runs tests/vm_checks/irqs_checks.py."""

from __future__ import annotations

import pytest

from tests.vm import PYTHON, REPO, run_in_vm

KEEPER = (
    "keeper-nic-irqs-on-node1",  # the node-1 NIC's MSI-X IRQs on the rank's node-1 irq CPUs
    "keeper-enforce-after-move",  # moved by hand -> observed -> re-written
    "keeper-restore",  # originals back
)
DAEMON = (
    "daemon-nic-irqs-on-rank-irq-cpus",  # `python -m supervisor run` binds them
    "daemon-api-observed-irqs",  # GET /placement shows them under observed.irqs
    "daemon-enforces-moved-irq",  # one moved by hand is put back by the check loop
    "daemon-restore-on-sigterm",  # and puts them back when it stops
)


def _daemon_wired() -> bool:
    return "IrqKeeper" in (REPO / "supervisor/daemon.py").read_text()


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_irqs_in_a_two_node_guest() -> None:
    done = run_in_vm(
        ["--nodes", "2"], [PYTHON, "-u", "tests/vm_checks/irqs_checks.py"], timeout_s=600
    )
    status = {
        line.split()[1].rstrip(":"): line.split()[0]
        for line in done.stdout.splitlines()
        if line.startswith(("PASS ", "FAIL ", "SKIP "))
    }
    wanted = KEEPER + (DAEMON if _daemon_wired() else ())
    for name in wanted:
        assert status.get(name) == "PASS", (
            f"{name}: {status.get(name)}\n{done.stdout}\n{done.stderr}"
        )
    assert "FAIL" not in status.values(), done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
