"""IRQ keeping in a real 2-node kernel: one guest boot runs tests/vm_checks/irqs_checks.py."""

from __future__ import annotations

import pytest

from tests.support.vm import run_checks_in_vm

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


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_irqs_in_a_two_node_guest() -> None:
    run_checks_in_vm("tests/vm_checks/irqs_checks.py", KEEPER + DAEMON)
