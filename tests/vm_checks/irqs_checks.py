"""IRQ keeping in a 2-node kernel; run INSIDE the test guest (as root).

    tests/guest/run-in-vm --nodes 2 -- .venv/bin/python -u tests/vm_checks/irqs_checks.py

Expects the default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3, a virtio-net
NIC with MSI-X IRQs at 0000:41:00.0 on node 1. Prints one "PASS name: detail"
or "FAIL name: detail" line per check (tests/vm.py's Checklist) and exits 1
if any failed. tests/watch/test_irqs_vm.py asserts on those lines.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from supervisor.config import IrqConfig
from supervisor.cpulist import parse_cpulist
from supervisor.hostfs import HostFS
from supervisor.plan.placement import PlanSettings
from supervisor.plan.planner import plan
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions
from supervisor.watch.irqs import IrqKeeper
from supervisor.watch.observe import read_irq_delivery
from tests.support.daemon_support import DaemonProcess
from tests.support.poll import wait_until
from tests.support.vm import Checklist

NIC = "0000:41:00.0"  # virtio-net on node 1
NODE1_CPUS = {2, 3}
CHECKS = Checklist()


def msi_irqs(bdf: str) -> list[int]:
    return sorted(int(n) for n in os.listdir(f"/sys/bus/pci/devices/{bdf}/msi_irqs"))


def affinity(irq: int, name: str = "smp_affinity_list") -> str:
    try:
        with open(f"/proc/irq/{irq}/{name}") as f:
            return f.read().strip()
    except OSError:
        return "?"


def snapshot_irqs(irqs: list[int]) -> dict[int, str]:
    return {irq: affinity(irq) for irq in irqs}


def describe(irqs: list[int]) -> str:
    return " ".join(
        f"{irq}:{affinity(irq)}/eff={affinity(irq, 'effective_affinity_list')}" for irq in irqs
    )


@CHECKS.guarded("keeper-nic-irqs-on-node1")
def keeper_alone() -> None:
    irqs = msi_irqs(NIC)
    before = snapshot_irqs(irqs)
    fs = HostFS("/")
    topology = read_topology(fs, DiscoveryOptions(accelerator="pci", pci_devices=(NIC,)))
    placement = plan(topology, PlanSettings(engine=False, rank_roles={"irq": 1}))
    (rank,) = placement.ranks
    irq_cpus = set(rank.slot.role_cpus("irq"))
    keeper = IrqKeeper(fs, IrqConfig())
    try:
        outcomes = keeper.apply(placement)
        bound = [o.irq for o in outcomes if o.status == "bound"]
        on_cpus = all(parse_cpulist(affinity(irq)) == irq_cpus for irq in irqs)
        delivered = all(set(read_irq_delivery(fs, irq) or ()) <= irq_cpus for irq in irqs)
        CHECKS.check(
            "keeper-nic-irqs-on-node1",
            bound == irqs and irq_cpus <= NODE1_CPUS and on_cpus and delivered,
            f"rank cpus={sorted(rank.slot.cpus)} irq={sorted(irq_cpus)} bound={bound} "
            f"msix={irqs} now {describe(irqs)}",
        )
        victim = irqs[-1]
        with open(f"/proc/irq/{victim}/smp_affinity_list", "w") as f:
            f.write("0")
        seen = {o.irq: o.cpus for o in keeper.observe(placement)[0]}
        fixed = keeper.enforce(0, placement)
        CHECKS.check(
            "keeper-enforce-after-move",
            seen[victim] == (0,)
            and [o.irq for o in fixed] == [victim]
            and parse_cpulist(affinity(victim)) == irq_cpus,
            f"moved {victim} to 0, observed {seen[victim]}, re-written {[o.irq for o in fixed]}, "
            f"now {affinity(victim)}",
        )
    finally:
        keeper.restore()
    after = snapshot_irqs(irqs)
    CHECKS.check("keeper-restore", after == before, f"before {before} after {after}")


def irq_cpus_of(rank: dict[str, Any]) -> set[int]:
    return set(rank["roles"].get("irq") or rank["roles"]["main"])


@CHECKS.guarded("daemon-nic-irqs-on-rank-irq-cpus")
def daemon_run() -> None:
    irqs = msi_irqs(NIC)
    before = snapshot_irqs(irqs)
    workdir = Path(tempfile.mkdtemp(prefix="irqs-vm-"))
    config = workdir / "irqs.toml"
    config.write_text(
        f'devices = ["{NIC}"]\n'
        'accelerator = "pci"\n'
        "stop_timeout_s = 5\n"
        'cgroup = "off"\n'
        "[workers]\n"
        'command = ["python", "-c", "import time; time.sleep(3600)"]\n'
        "[placement]\n"
        "rank_roles = { irq = 1 }\n"
        "[placement.engine]\n"
        "enabled = false\n"
        "[drift]\n"
        "check_interval_s = 0.5\n"
    )
    daemon = DaemonProcess(config, workdir / "daemon.log")
    try:
        # The plan: rank 0 on the NIC's node; its irq role CPUs.
        last: list[dict[str, Any]] = []

        def bound() -> bool:
            if daemon.proc.poll() is not None:
                return True  # exited: nothing more to wait for
            got = daemon.get("/placement")
            if got is None:
                return False
            last[:] = [got]
            ranks = got["ranks"]
            return (
                bool(ranks)
                and ranks[0].get("state") == "running"
                and all(parse_cpulist(affinity(i)) == irq_cpus_of(ranks[0]) for i in irqs)
            )

        wait_until(bound, 120, 0.2)
        assert last, f"no API answer; log: {daemon.tail(1 << 20)}"
        rank = last[0]["ranks"][0]
        irq_cpus = irq_cpus_of(rank)
        applied = {i: affinity(i) for i in irqs}
        ok = (
            rank["device"]["bus_id"] == NIC
            and irq_cpus <= NODE1_CPUS
            and all(parse_cpulist(v) == irq_cpus for v in applied.values())
            and all(set(read_irq_delivery(HostFS("/"), i) or ()) <= irq_cpus for i in irqs)
        )
        CHECKS.check(
            "daemon-nic-irqs-on-rank-irq-cpus",
            ok,
            f"rank cpus={rank['cpus']} irq={sorted(irq_cpus)} now {describe(irqs)}",
        )

        # The API shows them once the check loop has run (observed.irqs).
        def observed_irqs() -> list[dict[str, Any]]:
            got = daemon.get("/placement") or {"ranks": [{}]}
            return list((got["ranks"][0].get("observed") or {}).get("irqs") or [])

        shown = wait_until(observed_irqs, 30, 0.3)
        ids = sorted(int(e["irq"]) for e in shown)
        CHECKS.check(
            "daemon-api-observed-irqs", bool(shown) and ids == irqs, f"observed.irqs={shown}"
        )
        if shown:
            # Moved by hand: the check loop sees it and (policy enforce) puts it back.
            victim = irqs[0]
            with open(f"/proc/irq/{victim}/smp_affinity_list", "w") as f:
                f.write("0")
            wait_until(lambda: parse_cpulist(affinity(victim)) == irq_cpus, 30, 0.2)
            text = json.dumps(daemon.get("/events"))
            CHECKS.check(
                "daemon-enforces-moved-irq",
                parse_cpulist(affinity(victim)) == irq_cpus and f"irq {victim}" in text,
                f"irq {victim} moved to 0, now {affinity(victim)}",
            )
    finally:
        code = daemon.stop(timeout_s=60)
    after = snapshot_irqs(irqs)
    CHECKS.check(
        "daemon-restore-on-sigterm",
        after == before and code == 0,
        f"exit {code}; before {before} after {after}",
    )
    if CHECKS.failed:
        print(daemon.tail(6000), flush=True)


def main() -> int:
    keeper_alone()
    daemon_run()
    return CHECKS.exit_code()


if __name__ == "__main__":
    sys.exit(main())
