"""IRQ affinity writes and irqbalance coordination (does I/O: /proc/irq, a unix socket).

`IrqBinder` writes `proc/irq/N/smp_affinity_list` through HostFS, remembers
each IRQ's original affinity the first time it touches it (in memory, and
before the write in the checkpoint file when given one: supervisor.bind.irq_checkpoint),
and puts them all back on `restore_all()`. irqbalance would move our IRQs again within its
10 s cycle: `ban_irqs` asks it (through its own control socket) to leave them
alone. irqbalance itself is never stopped or reconfigured otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from supervisor.cpulist import format_cpulist, parse_cpulist
from supervisor.errors import Denied, KernelError, ManagedIrq, translate_oserror
from supervisor.hostfs import HostFS
from supervisor.procfs.walk import walk_host

IRQBALANCE_SOCKET_DIR = "run/irqbalance"  # irqbalance's SOCKET_TMPFS
IRQBALANCE_COMM = "irqbalance"
# irqbalance reads at most 500 bytes per request (irqbalance.c sock_handle).
_IRQBALANCE_MAX_REQUEST = 500


class OriginalsStore(Protocol):
    """Where originals go before the first write (supervisor.bind.irq_checkpoint.IrqCheckpoint):
    the host's, shared by the instances of one host."""

    @property
    def path(self) -> str: ...

    def __contains__(self, irq: object) -> bool: ...

    def add(self, originals: Mapping[int, Iterable[int]]) -> Mapping[int, frozenset[int]]: ...

    def discard(self, irqs: Iterable[int]) -> None: ...

    def locked(self) -> contextlib.AbstractContextManager[None]: ...

    def held_by_others(self, irqs: Iterable[int]) -> Mapping[int, int]: ...


class IrqBinder:
    """Sets IRQ affinity and restores what it changed."""

    __slots__ = ("_original", "_saved", "checkpoint", "fs")

    def __init__(self, fs: HostFS, checkpoint: OriginalsStore | None = None) -> None:
        self.fs = fs
        self.checkpoint = checkpoint
        self._original: dict[int, frozenset[int]] = {}
        self._saved: set[int] = set()  # IRQs this binder put in the checkpoint

    def __repr__(self) -> str:
        return f"IrqBinder({self.fs!r}, touched={sorted(self._original)})"

    def _rel(self, irq: int, name: str) -> str:
        return f"proc/irq/{irq}/{name}"

    def read_affinity(self, irq: int) -> frozenset[int]:
        """The CPUs the IRQ may be delivered to (smp_affinity_list); Gone if no such IRQ."""
        rel = self._rel(irq, "smp_affinity_list")
        try:
            return parse_cpulist(self.fs.read_text(rel))
        except OSError as err:
            raise translate_oserror(f"irq {irq}", err) from None

    def read_effective(self, irq: int) -> frozenset[int] | None:
        """The CPU(s) the IRQ is delivered to now (effective_affinity_list, Linux 4.15+
        with CONFIG_GENERIC_IRQ_EFFECTIVE_AFF_MASK); None where the kernel lacks it.

        On x86 without interrupt remapping, a new affinity takes effect at the
        IRQ's next interrupt, so this may lag a write until the device fires.
        """
        text = self.fs.read_optional(self._rel(irq, "effective_affinity_list"))
        return None if text is None else parse_cpulist(text)

    @property
    def touched(self) -> dict[int, frozenset[int]]:
        """IRQs changed so far, with the affinity each had before the first change."""
        return dict(self._original)

    def save_originals(self, irqs: Iterable[int]) -> None:
        """Put the current affinity of those `irqs` not yet in the checkpoint into it, in
        one write (before a batch of binds: `bind` would write the file once per IRQ).
        An IRQ that cannot be read is left to `bind` to report."""
        if self.checkpoint is None:
            return
        found: dict[int, frozenset[int]] = {}
        for irq in irqs:
            if irq in self.checkpoint or irq in self._original or irq in found:
                continue
            try:
                found[irq] = self.read_affinity(irq)
            except KernelError:
                continue
        try:
            self.checkpoint.add(found)
        except OSError:
            return  # each `bind` tries again and refuses to move its IRQ (Denied)
        self._saved.update(found)

    def bind(self, irq: int, cpus: Iterable[int]) -> frozenset[int]:
        """Write `cpus` to the IRQ's smp_affinity_list; returns the effective affinity
        read back (the affinity itself where effective_affinity_list is absent).

        Raises ManagedIrq for a kernel-managed IRQ (multi-queue NVMe, virtio-blk,
        some NIC queues: the kernel spreads those itself), Denied when /proc/irq
        is read-only or we lack privilege (the caller turns IRQ binding off),
        Gone when the IRQ does not exist, Invalid for CPUs the IRQ cannot use.
        """
        wanted = frozenset(cpus)
        target = f"irq {irq}"
        before = self.read_affinity(irq)
        if self.checkpoint is not None and irq not in self._original:
            # Durable before the first write: whatever ends this process next,
            # the host's own affinity can be found again (no-op when saved). The
            # original is the host's: another instance that moved it first has it.
            try:
                before = self.checkpoint.add({irq: before})[irq]
            except OSError as err:
                # Not durable, not moved: an original in memory only is lost to a
                # SIGKILL. Denied turns IRQ binding off for the run, said once.
                raise Denied(f"irq {irq}: checkpoint {self.checkpoint.path}", err) from None
            self._saved.add(irq)
        self._write(irq, format_cpulist(wanted), target)
        # Remembered only once a write went through: a refused IRQ is unchanged.
        self._original.setdefault(irq, before)
        effective = self.read_effective(irq)
        return effective if effective is not None else self.read_affinity(irq)

    def _write(self, irq: int, text: str, target: str) -> None:
        # open() and write() are separate on purpose: a read-only /proc (EROFS)
        # or missing privilege (EACCES) fails the open; the kernel's refusal of
        # a managed IRQ fails the write, with EIO before Linux 6.12 and EPERM
        # since (commit eb29369fa543, "genirq/proc: Change the return value for
        # set affinity permission error"). Both mean "this IRQ", not "all IRQs".
        path = self.fs.path(self._rel(irq, "smp_affinity_list"))
        try:
            # O_TRUNC as a shell's ">" does: ignored by procfs, right for fixture trees.
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        except OSError as err:
            raise translate_oserror(target, err) from None
        try:
            os.write(fd, text.encode())
        except OSError as err:
            if err.errno in (errno.EIO, errno.EPERM):
                raise ManagedIrq(target, err) from None
            raise translate_oserror(target, err) from None
        finally:
            os.close(fd)

    def restore(self, irq: int) -> None:
        """Put one IRQ's original affinity back (no-op for an IRQ never bound)."""
        with self._shared():
            self._restore(irq, self._held((irq,)))
            self._forget((irq,))

    def _shared(self) -> contextlib.AbstractContextManager[None]:
        # The host-wide lock across "does another instance still hold it?" and the
        # write: an instance recording it meanwhile would take our value for original.
        return self.checkpoint.locked() if self.checkpoint is not None else contextlib.nullcontext()

    def _held(self, irqs: Iterable[int]) -> Mapping[int, int]:
        return {} if self.checkpoint is None else self.checkpoint.held_by_others(irqs)

    def _restore(self, irq: int, held: Mapping[int, int]) -> None:
        original = self._original.get(irq)
        if original is None:
            return
        if irq not in held:  # else the last instance using it writes the host's back
            self._write(irq, format_cpulist(original), f"irq {irq}")
        del self._original[irq]

    def _forget(self, irqs: Iterable[int]) -> None:
        """Drop IRQs that are back (or never moved) from the checkpoint."""
        done = [irq for irq in irqs if irq in self._saved and irq not in self._original]
        if self.checkpoint is not None and done:
            self.checkpoint.discard(done)
        self._saved.difference_update(done)

    def restore_all(self) -> list[tuple[int, KernelError | None]]:
        """Restore every IRQ this binder changed; one (irq, error or None) per IRQ.

        An IRQ that vanished (device unplugged: Gone) counts as restored. Every
        restored IRQ (and any saved but never moved) leaves the checkpoint in
        one write, which removes the file when nothing failed.
        """
        results: list[tuple[int, KernelError | None]] = []
        with self._shared():
            held = self._held(self._original)
            for irq in sorted(self._original):
                try:
                    self._restore(irq, held)
                    results.append((irq, None))
                except KernelError as err:
                    if err.reason == "gone":
                        self._original.pop(irq, None)
                    results.append((irq, err))
            self._forget(sorted(self._saved))
        return results


# -- irqbalance ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IrqbalanceInfo:
    """A running irqbalance and where its control socket is."""

    pid: int
    socket_path: str  # absolute filesystem path, or "" for the abstract socket


def detect_irqbalance(fs: HostFS) -> IrqbalanceInfo | None:
    """The running irqbalance (a process whose comm is "irqbalance"), or None.

    irqbalance (built with its UI support) listens on a stream socket
    `/run/irqbalance/irqbalance<pid>.sock`, or, when it cannot create that file,
    on the abstract address made of zero bytes (irqbalance.c init_socket()).
    """
    for pid, comm in walk_host(fs, "irqbalance search", lambda pid: _comm(fs, pid)):
        if comm != IRQBALANCE_COMM:
            continue
        rel = f"{IRQBALANCE_SOCKET_DIR}/irqbalance{pid}.sock"
        return IrqbalanceInfo(pid, fs.path(rel) if fs.exists(rel) else "")
    return None


def _comm(fs: HostFS, pid: int) -> str | None:
    raw = fs.read_live(f"proc/{pid}/comm", 64, f"pid {pid}")  # TASK_COMM_LEN is 16
    return None if raw is None else raw.decode("utf-8", "replace").strip()


def _irqbalance_request(info: IrqbalanceInfo, request: str, timeout_s: float) -> bytes:
    """Send one request and read the reply until irqbalance closes the connection.

    irqbalance accepts a request only with SCM_CREDENTIALS of uid 0 attached
    (it sets SO_PASSCRED and checks the uid), one request per connection.
    """
    data = request.encode()
    if len(data) > _IRQBALANCE_MAX_REQUEST:
        raise ValueError(f"irqbalance request longer than {_IRQBALANCE_MAX_REQUEST} bytes")
    # The abstract fallback: sun_path of 108 zero bytes (sizeof(sockaddr_un) - 2).
    address: str | bytes = info.socket_path or b"\0" * 108
    creds = struct.pack("3i", os.getpid(), os.geteuid(), os.getegid())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(address)
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
        chunks: list[bytes] = []
        while chunk := sock.recv(8192):
            chunks.append(chunk)
    return b"".join(chunks)


def parse_irqbalance_setup(text: str) -> frozenset[int]:
    """The IRQs banned through the socket, from irqbalance's `setup` reply
    ("SLEEP 10 IRQ 41 LOAD 0 DIFF 0 CLASS 3 ... BANNED 00000000")."""
    words = text.split()
    return frozenset(
        int(words[i + 1])
        for i, word in enumerate(words[:-1])
        if word == "IRQ" and words[i + 1].isdigit()
    )


def read_banned_irqs(info: IrqbalanceInfo, timeout_s: float = 2.0) -> frozenset[int] | None:
    """The IRQs currently banned through irqbalance's socket; None when it does not answer."""
    try:
        reply = _irqbalance_request(info, "setup", timeout_s)
    except OSError:
        return None
    return parse_irqbalance_setup(reply.decode("ascii", "replace"))


def ban_irqs(info: IrqbalanceInfo, irqs: Iterable[int], timeout_s: float = 2.0) -> bool:
    """Ask irqbalance to stop moving `irqs` ("settings ban irqs 41 42"); True when sent.

    The command replaces irqbalance's whole socket-banned list, so pass every
    IRQ this supervisor manages (an empty set sends "NONE": unban all). IRQs
    banned on irqbalance's command line (--banirq) are a separate list and stay.
    False when irqbalance is not reachable: the caller logs it and keeps
    re-applying affinity on drift instead.
    """
    ids = sorted(set(irqs))
    request = "settings ban irqs " + (" ".join(str(i) for i in ids) if ids else "NONE")
    try:
        _irqbalance_request(info, request, timeout_s)
    except (OSError, ValueError):
        return False
    return True
