"""IRQ affinity on this machine's real IRQs, and irqbalance's control socket protocol."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.bind.irq import (
    IrqbalanceInfo,
    IrqBinder,
    ban_irqs,
    detect_irqbalance,
    parse_irqbalance_setup,
    read_banned_irqs,
)
from supervisor.errors import Gone, ManagedIrq
from supervisor.hostfs import HostFS
from tests.support.irqbalance import FakeIrqbalance, serve_fake_irqbalance

# virtio3 (0000:00:04.0) on this machine; any PCI device with writable MSI IRQs will do.
PREFERRED_DEVICE = "0000:00:04.0"


def msi_irqs(fs: HostFS, bdf: str) -> list[int]:
    return sorted(int(n) for n in fs.listdir(f"sys/bus/pci/devices/{bdf}/msi_irqs"))


def interrupt_count(irq: int) -> int:
    with open("/proc/interrupts") as f:
        for line in f:
            head, _, rest = line.partition(":")
            if head.strip() == str(irq):
                return sum(int(w) for w in rest.split() if w.isdigit())
    raise AssertionError(f"irq {irq} not in /proc/interrupts")


@pytest.fixture
def binder(need_root: None) -> Iterator[IrqBinder]:
    b = IrqBinder(HostFS("/"))
    yield b
    # Restoration is guaranteed even when the test failed half-way.
    before = b.touched
    results = b.restore_all()
    assert all(err is None for _, err in results), results
    for irq, original in before.items():
        assert b.read_affinity(irq) == original


@pytest.fixture
def device_irqs(binder: IrqBinder) -> list[int]:
    fs = binder.fs
    irqs = msi_irqs(fs, PREFERRED_DEVICE)
    if not irqs:
        pytest.skip(f"no MSI IRQs on {PREFERRED_DEVICE} here")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    return irqs


def test_bind_reads_back_and_restore_puts_the_original_back(
    binder: IrqBinder, device_irqs: list[int]
) -> None:
    target = max(os.sched_getaffinity(0))
    irq = device_irqs[1] if len(device_irqs) > 1 else device_irqs[0]
    original = binder.read_affinity(irq)
    count_before = interrupt_count(irq)
    effective = binder.bind(irq, {target})
    assert binder.read_affinity(irq) == {target}
    assert binder.touched == {irq: original}
    # On x86 without interrupt remapping the move happens at the next
    # interrupt: once the IRQ has fired, effective must be inside the new mask.
    deadline = time.monotonic() + 2
    while not effective <= {target} and time.monotonic() < deadline:
        time.sleep(0.01)
        effective = binder.read_effective(irq) or binder.read_affinity(irq)
    if not effective <= {target}:
        assert interrupt_count(irq) == count_before, "fired, yet effective affinity is stale"
    # A second bind keeps the first original.
    binder.bind(irq, set(os.sched_getaffinity(0)))
    assert binder.touched == {irq: original}
    assert binder.restore_all() == [(irq, None)]
    assert binder.read_affinity(irq) == original
    assert binder.touched == {}


def test_two_irqs_of_one_device(binder: IrqBinder, device_irqs: list[int]) -> None:
    target = min(os.sched_getaffinity(0))
    chosen = device_irqs[-2:]
    originals = {irq: binder.read_affinity(irq) for irq in chosen}
    for irq in chosen:
        binder.bind(irq, {target})
        assert binder.read_affinity(irq) == {target}
    results = binder.restore_all()
    assert sorted(irq for irq, _ in results) == sorted(chosen)
    assert {irq: binder.read_affinity(irq) for irq in chosen} == originals


def test_managed_irq_is_refused_and_left_alone(binder: IrqBinder) -> None:
    fs = binder.fs
    candidates = [irq for bdf in fs.listdir("sys/bus/pci/devices") for irq in msi_irqs(fs, bdf)]
    for irq in candidates:
        current = binder.read_affinity(irq)
        try:
            binder.bind(irq, current)  # same mask: no change where it is allowed
        except ManagedIrq:
            break
    else:
        pytest.skip("no kernel-managed IRQ on this machine")
    with pytest.raises(ManagedIrq) as info:
        binder.bind(irq, current)
    assert info.value.errno_name in ("EIO", "EPERM")  # EPERM since Linux 6.12
    assert info.value.target == f"irq {irq}"
    assert irq not in binder.touched  # refused: nothing to restore
    assert binder.read_affinity(irq) == current


def test_read_only_proc_irq_is_denied_not_managed(need_root: None, tmp_path: Path) -> None:
    # What a container sees: /proc/irq bind-mounted read-only (Docker does this).
    # Done in a private mount namespace, so the host's /proc/irq is untouched.
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) not installed")
    irqs = [int(n) for n in os.listdir("/proc/irq") if n.isdigit()]
    irq = next(i for i in sorted(irqs) if os.path.exists(f"/proc/irq/{i}/smp_affinity_list"))
    code = (
        "from supervisor.bind.irq import IrqBinder\n"
        "from supervisor.hostfs import HostFS\n"
        "b = IrqBinder(HostFS('/'))\n"
        f"try:\n    b.bind({irq}, [0])\n"
        "except Exception as e:\n    print(type(e).__name__, e.errno_name, len(b.touched))\n"
    )
    script = tmp_path / "probe.py"
    script.write_text(code)
    shell = (
        "mount --bind /proc/irq /proc/irq && mount -o remount,bind,ro /proc/irq && "
        f"exec {sys.executable} {script}"
    )
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", shell],
        check=False,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    if "mount" in done.stderr and done.returncode != 0 and not done.stdout:
        pytest.skip(f"cannot make a private read-only /proc/irq: {done.stderr.strip()}")
    assert done.stdout.split() == ["Denied", "EROFS", "0"], done.stderr


def test_unknown_irq_is_gone(tmp_path: Path) -> None:
    binder = IrqBinder(HostFS(str(tmp_path)))
    with pytest.raises(Gone):
        binder.bind(99999, [0])
    assert binder.touched == {}


def test_fixture_tree_bind_and_restore(tmp_path: Path) -> None:
    d = tmp_path / "proc/irq/77"
    d.mkdir(parents=True)
    (d / "smp_affinity_list").write_text("0-7\n")
    binder = IrqBinder(HostFS(str(tmp_path)))
    assert binder.read_effective(77) is None  # an old kernel: no effective_affinity_list
    assert binder.bind(77, [2, 3]) == {2, 3}
    assert (d / "smp_affinity_list").read_text().strip() == "2-3"
    assert binder.restore_all() == [(77, None)]
    assert (d / "smp_affinity_list").read_text().strip() == "0-7"


# -- irqbalance ------------------------------------------------------------------


@pytest.fixture
def fake_irqbalance(tmp_path: Path) -> Iterator[tuple[HostFS, FakeIrqbalance]]:
    (tmp_path / "proc/1").mkdir(parents=True)
    (tmp_path / "proc/1/comm").write_text("init\n")
    server = serve_fake_irqbalance(tmp_path, 4321)
    yield HostFS(str(tmp_path)), server
    server.close()


def test_detect_and_ban_through_the_socket(
    need_root: None, fake_irqbalance: tuple[HostFS, FakeIrqbalance]
) -> None:
    fs, server = fake_irqbalance
    info = detect_irqbalance(fs)
    assert info is not None
    assert info.pid == 4321
    assert info.socket_path == fs.path("run/irqbalance/irqbalance4321.sock")
    assert ban_irqs(info, [42, 41, 42])
    assert server.requests[-1] == ("settings ban irqs 41 42", 0)
    assert read_banned_irqs(info) == {41, 42}
    assert ban_irqs(info, [])
    assert server.requests[-1] == ("settings ban irqs NONE", 0)
    assert read_banned_irqs(info) == frozenset()


def test_unreachable_irqbalance_is_false_not_an_error(tmp_path: Path) -> None:
    info = IrqbalanceInfo(1, str(tmp_path / "no.sock"))
    assert ban_irqs(info, [41]) is False
    assert read_banned_irqs(info) is None


def test_no_irqbalance_process(tmp_path: Path) -> None:
    (tmp_path / "proc/1").mkdir(parents=True)
    (tmp_path / "proc/1/comm").write_text("init\n")
    assert detect_irqbalance(HostFS(str(tmp_path))) is None


def test_parse_irqbalance_setup() -> None:
    text = "SLEEP 10 IRQ 41 LOAD 5 DIFF 1 CLASS 3 IRQ 42 LOAD 0 DIFF 0 CLASS 3 BANNED 0000000f"
    assert parse_irqbalance_setup(text) == {41, 42}
    assert parse_irqbalance_setup("SLEEP 10 BANNED 00000000") == frozenset()
