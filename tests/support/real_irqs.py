"""A device's real IRQs in a test: moved to a known value first, put back afterwards.

Does I/O: writes /proc/irq/<n>/smp_affinity_list (root). A test never assumes
the affinity it finds (irqbalance, an operator or another test run may have
left anything there): `known_irqs` moves every writable IRQ to all of this
process's CPUs, which no single-CPU irq role equals, lets the test run, then
writes each IRQ's value from before back and checks it. A host-wide lock
(`irq_lock`) keeps two test runs on one host from moving the same IRQs at once,
and lets the session-end check (tests/support/host_residue.py) read them at rest.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
import time
from collections.abc import Iterable, Iterator

from supervisor.cpulist import format_cpulist

LOCK_PATH = os.path.join(tempfile.gettempdir(), "placement-supervisor-tests-irqs.lock")
# The longest a test holds the IRQs (a daemon started, bound, stopped): a run
# waiting longer than this for another run's test is stuck, not queued.
LOCK_WAIT_S = 600.0


def affinity(irq: int) -> str:
    with open(f"/proc/irq/{irq}/smp_affinity_list") as f:
        return f.read().strip()


def write_affinity(irq: int, cpus: str) -> None:
    with open(f"/proc/irq/{irq}/smp_affinity_list", "w") as f:
        f.write(cpus)


def known_value() -> str:
    """Every CPU this process may use: differs from any one-CPU irq role when there are two."""
    return format_cpulist(os.sched_getaffinity(0))


@contextlib.contextmanager
def irq_lock(wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the host-wide test IRQ lock (flock on LOCK_PATH)."""
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise AssertionError(
                        f"{LOCK_PATH}: another test run held the real IRQs for {wait_s:.0f}s"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


def _refused(err: OSError) -> bool:
    # A kernel-managed IRQ: EIO before Linux 6.12, EPERM since (genirq/proc, eb29369fa543).
    return err.errno in (errno.EIO, errno.EPERM)


@contextlib.contextmanager
def known_irqs(irqs: Iterable[int]) -> Iterator[dict[int, str]]:
    """Under `irq_lock`: each IRQ moved to `known_value()` (a kernel-managed one, which
    refuses every write, stays where it is); yields each IRQ's value at the test's
    start. Afterwards every IRQ gets its value from before back, checked."""
    with irq_lock():
        before = {irq: affinity(irq) for irq in sorted(irqs)}
        known = known_value()
        start: dict[int, str] = {}
        try:
            for irq in before:
                try:
                    write_affinity(irq, known)
                except OSError as err:
                    if not _refused(err):
                        raise
                start[irq] = affinity(irq)
            yield start
        finally:
            for irq, cpus in before.items():
                if affinity(irq) != cpus:
                    with contextlib.suppress(OSError):
                        write_affinity(irq, cpus)
            after = {irq: affinity(irq) for irq in before}
            assert after == before, f"IRQ affinities not put back: {before} -> {after}"


def read_all_affinities() -> dict[int, str]:
    """Every IRQ's smp_affinity_list on this host (an IRQ freed meanwhile is left out)."""
    out: dict[int, str] = {}
    for name in os.listdir("/proc/irq"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                out[int(name)] = affinity(int(name))
    return out


@contextlib.contextmanager
def every_irq_put_back() -> Iterator[None]:
    """Every IRQ of the host that changed inside the block is written back afterwards:
    for a program that may move any of them (a real irqbalance balances at start)."""
    before = read_all_affinities()
    try:
        yield
    finally:
        for irq, cpus in read_all_affinities().items():
            if irq in before and cpus != before[irq]:
                with contextlib.suppress(OSError):
                    write_affinity(irq, before[irq])
