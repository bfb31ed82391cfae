"""Trees captured with `placement-supervisor snapshot` inside real multi-NUMA
guests (the test guest's presets 2node and cpuless, guest kernel 6.1), with the plan and
topology the live guest printed at the same moment. Discovery and planning of
the captured tree on this machine must reproduce them exactly: the
`snapshot` -> `plan --root` promise of docs/contracts.md §1, across machines.

To recapture (as root, from the repo; the guest's writes are lost, so the tree
comes back as a tar on stdout):
    tests/guest/run-in-vm --preset 2node -- bash -c '.venv/bin/python -m supervisor
      snapshot /tmp/cap/numavm-2node --config tests/fixtures/captured/guest-nics.toml
      && ... && tar -C /tmp/cap -c .' | tar -x -C DIR
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor import cli
from supervisor.plan.placement import Placement
from supervisor.topology.render import topology_to_doc
from tests.support.plan_invariants import check_placement

CAPTURED = Path(__file__).resolve().parents[1] / "fixtures" / "captured"
CONFIG = str(CAPTURED / "guest-nics.toml")
HOSTS = ("numavm-2node", "numavm-cpuless")


@pytest.mark.parametrize("host", HOSTS)
def test_plan_of_the_capture_is_the_plan_the_guest_printed(host: str) -> None:
    topology, placement = cli.make_plan(str(CAPTURED / host), CONFIG, {})
    printed = json.loads((CAPTURED / f"{host}.plan.json").read_text())
    assert placement.to_doc() == printed
    check_placement(topology, Placement.from_doc(printed))


@pytest.mark.parametrize("host", HOSTS)
def test_topology_of_the_capture_is_what_the_guest_printed(host: str) -> None:
    topology, _ = cli.make_plan(str(CAPTURED / host), None, {})
    assert topology_to_doc(topology) == json.loads((CAPTURED / f"{host}.topology.json").read_text())


def test_the_guests_nics_are_numa_local_devices_with_their_msix_irqs() -> None:
    topology, placement = cli.make_plan(str(CAPTURED / "numavm-2node"), CONFIG, {})
    by_bdf = {d.bdf: d for d in topology.devices}
    assert by_bdf["0000:21:00.0"].numa_node == 0
    assert by_bdf["0000:41:00.0"].numa_node == 1
    assert all(len(by_bdf[b].irqs) >= 3 for b in by_bdf)  # virtio-net: config + rx + tx
    # The guest's /proc/interrupts names no PCI address ("PCI-MSI 16384-edge
    # virtio0-config"): the NICs' IRQs come from msi_irqs/ alone.
    nics = {n.bdf: n for n in topology.nics if n.bdf in by_bdf}
    assert set(nics) == set(by_bdf)
    assert all(nics[b].irqs == by_bdf[b].irqs for b in by_bdf)
    # Each NIC's rank sits on its own node, with an irq CPU there.
    node_cpus = {n.id: set(n.cpus) for n in topology.nodes}
    for rank in placement.ranks:
        node = rank.device.numa_node
        assert node is not None
        assert set(rank.slot.cpus) <= node_cpus[node]
        assert rank.slot.mems == (node,)
        assert set(rank.slot.roles["irq"]) <= node_cpus[node]


def test_the_cpuless_guest_has_a_memory_only_node_that_is_never_planned() -> None:
    topology, placement = cli.make_plan(str(CAPTURED / "numavm-cpuless"), CONFIG, {})
    memory_only = [n.id for n in topology.nodes if not n.cpus and n.mem_total_bytes > 0]
    assert memory_only == [2]
    assert all(2 not in r.slot.mems for r in placement.ranks)
