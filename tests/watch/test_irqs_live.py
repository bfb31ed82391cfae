"""The IRQ keeper on this machine's real /proc/irq (root).

The rank's device is virtio3 (0000:00:04.0, MSI-X IRQs 40-43 here), named in
the config the way an operator names any PCI device. Every test first moves
the IRQs to a known value (tests/support/real_irqs.py: whatever irqbalance or
another run left there is never assumed) and puts the values from before back
in a finalizer, even when it fails half-way.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.bind.irq import detect_irqbalance, read_banned_irqs
from supervisor.config import IrqConfig
from supervisor.cpulist import parse_cpulist
from supervisor.events import Recorder
from supervisor.hostfs import HostFS
from supervisor.plan.placement import Placement, PlanSettings
from supervisor.plan.planner import plan
from supervisor.state import Observation, Snapshot, StateStore
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions, Topology
from supervisor.watch.drift import diff
from supervisor.watch.irqs import IrqKeeper
from tests.support.daemon_support import (
    stop_process,
)
from tests.support.poll import poll
from tests.support.real_irqs import affinity, every_irq_put_back, known_irqs

DEVICE = "0000:00:04.0"  # virtio3: MSI-X IRQs that accept affinity writes
MANAGED_DEVICE = "0000:00:02.0"  # virtio-blk: its queue IRQ is kernel-managed
REPO = Path(__file__).resolve().parents[2]


def _setup(bdf: str) -> tuple[Topology, Placement]:
    fs = HostFS("/")
    topology = read_topology(fs, DiscoveryOptions(accelerator="pci", pci_devices=(bdf,)))
    # One irq CPU, the rest main: on this 2-CPU box the irq role is one CPU.
    settings = PlanSettings(engine=False, rank_roles={"irq": 1}, on_shortage="merge")
    return topology, plan(topology, settings)


@pytest.fixture
def originals(need_root: None) -> Iterator[dict[int, str]]:
    """IRQs of every PCI device we may touch, moved to a known value (all our CPUs:
    never the one-CPU irq role) under the host-wide test IRQ lock: the affinity each
    starts the test with. The values from before the test are put back afterwards."""
    if not os.path.isdir(f"/sys/bus/pci/devices/{DEVICE}/msi_irqs"):
        pytest.skip(f"{DEVICE} is not on this machine")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs: the irq role's and another to move the IRQs from")
    irqs: list[int] = []
    for bdf in (DEVICE, MANAGED_DEVICE):
        path = f"/sys/bus/pci/devices/{bdf}/msi_irqs"
        if os.path.isdir(path):
            irqs += [int(n) for n in os.listdir(path)]
    with known_irqs(irqs) as start:
        yield start


def test_keeper_on_real_irqs(originals: dict[int, str]) -> None:
    topology, placement = _setup(DEVICE)
    (rank,) = placement.ranks
    irq_cpus = rank.slot.role_cpus("irq")
    device = next(d for d in topology.devices if d.bdf == DEVICE)
    assert device.irqs, "discovery found no IRQs for the device"
    keeper = IrqKeeper(HostFS("/"), IrqConfig())
    try:
        outcomes = keeper.apply(placement)
        assert [(o.irq, o.status) for o in outcomes] == [(i, "bound") for i in device.irqs]
        for irq in device.irqs:
            assert parse_cpulist(affinity(irq)) == set(irq_cpus)
        # Moved off the known value the fixture set: a keeper that wrote nothing fails here.
        assert all(parse_cpulist(originals[i]) != set(irq_cpus) for i in device.irqs)

        obs = keeper.observe(placement)[0]
        assert [o.irq for o in obs] == list(device.irqs)
        assert all(o.planned == tuple(irq_cpus) and set(o.cpus) <= set(irq_cpus) for o in obs)
        assert diff(rank.slot, Observation(irqs=obs), threshold=0.0) == ()

        # Perturb one, as irqbalance or an operator would: another CPU, directly.
        victim = device.irqs[1] if len(device.irqs) > 1 else device.irqs[0]
        other = next(c for c in sorted(os.sched_getaffinity(0)) if c not in irq_cpus)
        with open(f"/proc/irq/{victim}/smp_affinity_list", "w") as f:
            f.write(str(other))
        obs = keeper.observe(placement)[0]
        seen = {o.irq: o.cpus for o in obs}
        assert seen[victim] == (other,)
        findings = diff(rank.slot, Observation(irqs=obs), threshold=0.0)
        assert [(f.kind, f.target) for f in findings] == [("irq_affinity", f"irq {victim}")]

        fixed = keeper.enforce(0, placement)
        assert [(o.irq, o.status) for o in fixed] == [(victim, "bound")]
        assert set(keeper.binder.read_affinity(victim)) == set(irq_cpus)
        assert diff(rank.slot, Observation(irqs=keeper.observe(placement)[0]), threshold=0.0) == ()
    finally:
        results = keeper.restore()
    assert all(err is None for _, err in results), results
    assert {irq: affinity(irq) for irq in device.irqs} == {i: originals[i] for i in device.irqs}


def _kernel_refuses(irq: int) -> bool:
    """True when the kernel refuses even the IRQ's current mask (a managed IRQ)."""
    path = f"/proc/irq/{irq}/smp_affinity_list"
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, affinity(irq).encode())
    except OSError as err:
        # EIO before Linux 6.12, EPERM since (genirq/proc, commit eb29369fa543).
        return err.errno in (errno.EIO, errno.EPERM)
    finally:
        os.close(fd)
    return False


def test_managed_irq_is_skipped_and_counted_once(originals: dict[int, str]) -> None:
    path = f"/sys/bus/pci/devices/{MANAGED_DEVICE}/msi_irqs"
    if not os.path.isdir(path):
        pytest.skip(f"{MANAGED_DEVICE} is not on this machine")
    irqs = sorted(int(n) for n in os.listdir(path))
    managed = [irq for irq in irqs if _kernel_refuses(irq)]
    if not managed:
        pytest.skip(f"no kernel-managed IRQ on {MANAGED_DEVICE} here")
    topology, placement = _setup(MANAGED_DEVICE)
    store = StateStore(Snapshot(placement, topology, {}))
    keeper = IrqKeeper(HostFS("/"), IrqConfig())
    try:
        outcomes = {o.irq: o.status for o in keeper.apply(placement)}
        for irq in managed:
            assert outcomes[irq] == "managed"
            assert affinity(irq) == originals[irq]
        keeper.apply(placement)  # refused again, reported once
        Recorder(store).facts(keeper.take_facts())
        assert store.snapshot.counters.bind_failures == {("0", "irq", "managed"): len(managed)}
        failed = [e for e in store.snapshot.events if e.kind == "bind_failed"]
        assert sorted(e.fields["irq"] for e in failed) == managed
        assert all("kernel-managed" in e.message for e in failed)
        # Not kept: no planned CPUs, so drift never fires on it.
        obs = {o.irq: o for o in keeper.observe(placement)[0]}
        assert all(obs[irq].planned == () and obs[irq].cpus for irq in managed)
        assert keeper.enforce(0, placement) == ()
    finally:
        keeper.restore()


def test_read_only_proc_irq_turns_binding_off_once(need_root: None) -> None:
    # What a container sees: /proc/irq bind-mounted read-only. A private mount
    # namespace keeps the host's /proc/irq writable.
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.watch.test_irqs_live import _setup
        from supervisor.config import IrqConfig
        from supervisor.hostfs import HostFS
        from supervisor.watch.irqs import IrqKeeper
        from supervisor.events import Recorder
        from supervisor.state import Snapshot, StateStore
        topology, placement = _setup({DEVICE!r})
        store = StateStore(Snapshot(placement, topology, {{}}))
        keeper = IrqKeeper(HostFS("/"), IrqConfig())
        first = keeper.apply(placement)
        second = keeper.apply(placement)
        Recorder(store).facts(keeper.take_facts())
        obs = keeper.observe(placement)[0]
        print(keeper.enabled, [o.status for o in first], len(second))
        print(dict(store.snapshot.counters.bind_failures))
        print(sum(e.kind == "bind_failed" for e in store.snapshot.events))
        print(all(o.planned == () for o in obs), len(obs))
        print(keeper.enforce(0, placement), keeper.restore())
        """
    )
    done = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount --bind /proc/irq /proc/irq && mount -o remount,bind,ro /proc/irq && "
            f'exec {sys.executable} -c "$0"',
            script,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0 and "mount" in done.stderr and "Traceback" not in done.stderr:
        pytest.skip(f"cannot make a private read-only /proc/irq: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "False ['off'] 0", done.stdout  # stopped at the first refusal
    assert lines[1] == "{('0', 'irq', 'denied'): 1}"
    assert lines[2] == "1"
    assert lines[3] == "True 4"
    assert lines[4] == "() []"


@pytest.fixture
def real_irqbalance(originals: dict[int, str]) -> Iterator[int]:
    """Debian's irqbalance, running for real (installed by .ci/setup).

    A one-hour interval keeps it from rebalancing while the test runs; without
    /run/irqbalance it listens on its abstract socket, as it does here.
    """
    binary = shutil.which("irqbalance") or "/usr/sbin/irqbalance"
    if not os.path.exists(binary):
        pytest.skip("irqbalance is not installed (.ci/setup installs it)")
    # It may move any IRQ of the host at its start: all are put back after it stops.
    with every_irq_put_back():
        proc = subprocess.Popen(
            [binary, "--foreground", "--interval=3600"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            fs = HostFS("/")

            def listening() -> bool:
                info = detect_irqbalance(fs)
                return info is not None and read_banned_irqs(info) is not None

            poll(listening, timeout_s=20, what="irqbalance's control socket")
            yield proc.pid
        finally:
            stop_process(proc, 10)


def test_keeper_bans_our_irqs_in_a_real_irqbalance_and_unbans_on_restore(
    real_irqbalance: int,
) -> None:
    topology, placement = _setup(DEVICE)
    device = next(d for d in topology.devices if d.bdf == DEVICE)
    store = StateStore(Snapshot(placement, topology, {}))
    keeper = IrqKeeper(HostFS("/"), IrqConfig(irqbalance="ban"))
    try:
        keeper.apply(placement)
        assert keeper.irqbalance is not None and keeper.irqbalance.pid == real_irqbalance
        # irqbalance itself says it now leaves every one of our IRQs alone.
        banned = read_banned_irqs(keeper.irqbalance)
        assert banned is not None and set(device.irqs) <= banned
        Recorder(store).facts(keeper.take_facts())
        assert any(e.kind == "irqbalance" for e in store.snapshot.events)
    finally:
        keeper.restore()
    info = keeper.irqbalance
    assert info is not None
    assert read_banned_irqs(info) == frozenset()  # its own list given back
    # And it was never stopped.
    assert os.path.exists(f"/proc/{real_irqbalance}")
