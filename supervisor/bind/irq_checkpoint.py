"""The IRQ checkpoint: the original affinity of every IRQ we move, in a state file
(does I/O: the file itself with plain os calls; /proc/irq through HostFS and IrqBinder).

Written before the first IRQ write, so that after an unclean end (the daemon
and its guardian killed, a crash) the next one to look puts the host's own
affinities back instead of taking ours for the originals. Pure parse/format/plan
functions first, then the file, then `restore_checkpoint`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from supervisor.bind.irq import IrqBinder
from supervisor.cpulist import format_cpulist, parse_cpulist
from supervisor.errors import KernelError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields

log = logging.getLogger("placement_supervisor.irq_checkpoint")

CHECKPOINT_VERSION = 1
# After a reboot the kernel has reset every IRQ's affinity: a checkpoint of
# another boot describes nothing on this one (proc(5), /proc/sys/kernel/random).
BOOT_ID_FILE = "proc/sys/kernel/random/boot_id"
ONLINE_CPUS_FILE = "sys/devices/system/cpu/online"
# A guardian restoring the same file holds its lock for the kill rounds
# (guardian.KILL_ROUNDS_S) plus the writes: wait a little longer than that.
LOCK_WAIT_S = 15.0
_LOCK_POLL_S = 0.02


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as a whole: garbled, wrong checksum, unknown version."""


# -- pure: the document ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IrqCheckpointData:
    """What a checkpoint holds: whose it is, from which boot, and IRQ -> original CPUs."""

    boot_id: str
    pid: int  # the daemon that wrote it (its guardian restores only its own)
    originals: Mapping[int, frozenset[int]] = field(default_factory=dict)


def _body(data: IrqCheckpointData) -> dict[str, Any]:
    return {
        "version": CHECKPOINT_VERSION,
        "boot_id": data.boot_id,
        "pid": data.pid,
        "irqs": {str(irq): format_cpulist(cpus) for irq, cpus in sorted(data.originals.items())},
    }


def _checksum(body: Mapping[str, Any]) -> str:
    # As the kubelet's checkpoints do (pkg/kubelet/checkpointmanager/checksum):
    # a checksum over the content, written beside it, checked on every read.
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def format_checkpoint(data: IrqCheckpointData) -> str:
    """The file's text: JSON with version, boot id, pid, irqs and checksum (pure)."""
    body = _body(data)
    return json.dumps({**body, "checksum": _checksum(body)}, indent=1, sort_keys=True) + "\n"


def parse_checkpoint(text: str) -> IrqCheckpointData:
    """The checkpoint in `text`; CheckpointError naming what is wrong (pure)."""
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise CheckpointError("not a JSON object")
    checksum = doc.pop("checksum", None)
    if doc.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"version {doc.get('version')!r}, expected {CHECKPOINT_VERSION}")
    if checksum != _checksum(doc):
        raise CheckpointError("checksum mismatch")
    boot_id, pid, irqs = doc.get("boot_id"), doc.get("pid"), doc.get("irqs")
    if set(doc) != {"version", "boot_id", "pid", "irqs"}:
        raise CheckpointError(f"fields {sorted(doc)}")
    if not isinstance(boot_id, str) or not isinstance(pid, int) or not isinstance(irqs, dict):
        raise CheckpointError("boot_id, pid or irqs of the wrong type")
    originals: dict[int, frozenset[int]] = {}
    for key, cpus in irqs.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(cpus, str)):
            raise CheckpointError(f"irq entry {key!r}: {cpus!r}")
        try:
            originals[int(key)] = parse_cpulist(cpus)
        except ValueError as err:
            raise CheckpointError(f"irq {key}: {err}") from None
    return IrqCheckpointData(boot_id, pid, MappingProxyType(originals))


# -- pure: what of it still fits the host -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """The writes that put a checkpoint back on this host, and what did not fit.

    `other_boot`: written before the last reboot, nothing to write. `gone`: IRQs
    this host no longer has. `narrowed`: IRQ -> the CPUs of its original that are
    offline now (the rest is written). `unfit`: none of its CPUs online: left as is.
    """

    writes: Mapping[int, frozenset[int]]
    other_boot: bool = False
    gone: tuple[int, ...] = ()
    narrowed: Mapping[int, frozenset[int]] = field(default_factory=dict)
    unfit: tuple[int, ...] = ()

    @property
    def fits(self) -> bool:
        return not (self.gone or self.narrowed or self.unfit)


def plan_restore(
    data: IrqCheckpointData,
    *,
    boot_id: str,
    irqs: Iterable[int],
    online_cpus: frozenset[int] | None,
) -> RestorePlan:
    """What to write to put `data` back on a host with `irqs` and `online_cpus` (pure).

    `online_cpus` None: unknown, every CPU list is taken as it is.
    """
    if data.boot_id != boot_id:
        return RestorePlan(MappingProxyType({}), other_boot=True)
    present = frozenset(irqs)
    writes: dict[int, frozenset[int]] = {}
    gone: list[int] = []
    narrowed: dict[int, frozenset[int]] = {}
    unfit: list[int] = []
    for irq, cpus in sorted(data.originals.items()):
        if irq not in present:
            gone.append(irq)
            continue
        fit = cpus if online_cpus is None else cpus & online_cpus
        if not fit:
            unfit.append(irq)
            continue
        if fit != cpus:
            narrowed[irq] = cpus - fit
        writes[irq] = fit
    return RestorePlan(
        MappingProxyType(writes),
        gone=tuple(gone),
        narrowed=MappingProxyType(narrowed),
        unfit=tuple(unfit),
    )


def misfit_fields(plan: RestorePlan) -> dict[str, object] | None:
    """The key=values of the one log line for a checkpoint that no longer fits (pure)."""
    if plan.fits:
        return None
    offline = frozenset().union(*plan.narrowed.values()) if plan.narrowed else frozenset()
    return {
        "irqs_gone": format_cpulist(plan.gone) or None,
        "irqs_narrowed": format_cpulist(plan.narrowed) or None,
        "cpus_offline": format_cpulist(offline) or None,
        "irqs_unfit": format_cpulist(plan.unfit) or None,
        "action": "applied as far as it fits",
    }


# -- the file ----------------------------------------------------------------------------------


def read_boot_id(fs: HostFS) -> str:
    """This boot's id ("" where the kernel or the tree has none)."""
    return (fs.read_optional(BOOT_ID_FILE) or "").strip()


def write_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` so that a crash or power loss leaves the old file or
    the new one, never a torn one: a temp file in the same directory, fsync, rename,
    fsync of the directory (rename(2) is atomic within one file system; the directory
    fsync makes the rename itself durable, fsync(2))."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".irqs-", suffix=".tmp", dir=directory)
    try:
        try:
            data = text.encode()
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class IrqCheckpoint:
    """This daemon's checkpoint file: the originals of the IRQs it moved (thread-safe).

    `add` before an IRQ is first written, `discard` once it is back; the file
    goes when nothing is left in it. A file that cannot be written is one
    warning; IRQ binding goes on with the originals in memory only.
    """

    def __init__(self, path: str, boot_id: str, pid: int | None = None) -> None:
        self.path = path
        self.boot_id = boot_id
        self.pid = os.getpid() if pid is None else pid
        self._originals: dict[int, frozenset[int]] = {}
        self._lock = threading.Lock()
        self._warned = False

    def __repr__(self) -> str:
        return f"IrqCheckpoint({self.path!r}, irqs={sorted(self._originals)})"

    def __contains__(self, irq: object) -> bool:
        return irq in self._originals

    @property
    def originals(self) -> dict[int, frozenset[int]]:
        return dict(self._originals)

    def add(self, originals: Mapping[int, Iterable[int]]) -> None:
        """Save the IRQs not in it yet (an IRQ already there keeps its first original)."""
        with self._lock:
            new = {irq: frozenset(c) for irq, c in originals.items() if irq not in self._originals}
            if not new:
                return
            self._originals.update(new)
            self._save()

    def discard(self, irqs: Iterable[int]) -> None:
        """Forget IRQs that are back on their originals; remove the file when empty."""
        with self._lock:
            gone = [irq for irq in irqs if self._originals.pop(irq, None) is not None]
            if gone:
                self._save()

    def _save(self) -> None:
        try:
            if self._originals:
                data = IrqCheckpointData(self.boot_id, self.pid, dict(self._originals))
                write_atomic(self.path, format_checkpoint(data))
            else:
                remove_file(self.path)
        except OSError as err:
            if not self._warned:
                self._warned = True
                log.warning(
                    "irq checkpoint write failed %s",
                    format_fields(
                        path=self.path,
                        error=err.strerror or err,
                        action="keep the originals in memory only",
                    ),
                )


def remove_file(path: str) -> None:
    """Unlink `path` (gone already is fine) and make the unlink durable."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    fsync_dir(os.path.dirname(path) or ".")


# -- restore ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RestoreReport:
    """What `restore_checkpoint` did with one checkpoint file."""

    path: str
    restored: tuple[int, ...] = ()
    failed: tuple[tuple[int, str], ...] = ()  # (irq, reason)
    discarded: str | None = None  # why the whole file was dropped unused
    plan: RestorePlan | None = None
    pid: int | None = None  # the daemon that wrote it


def _lock(fd: int, wait_s: float) -> bool:
    """flock(2) LOCK_EX on `fd`, polled up to `wait_s`; False when still held then."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(_LOCK_POLL_S)


def _same_file(path: str, st: os.stat_result) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def restore_checkpoint(
    fs: HostFS, path: str, *, owner: int | None = None, lock_wait_s: float = LOCK_WAIT_S
) -> RestoreReport | None:
    """Put the originals in the checkpoint at `path` back, log it, remove the file.

    None when there is none, when another process restored it first, or (with
    `owner`, the guardian's case) when it is not that daemon's. A file the
    guardian and a new daemon both reach is restored once: each takes flock(2)
    on it first, and the second sees it unlinked. Garbled or of another boot:
    discarded with one log line. What no longer fits the host is applied as far
    as it fits, with one log line. A file that cannot be read at all (not a
    file, no permission) is one line and left where it is. Blocking.
    """
    try:
        return _restore(fs, path, owner, lock_wait_s)
    except OSError as err:
        log.warning(
            "irq checkpoint unreadable %s",
            format_fields(path=path, error=err.strerror or err, action="skip, leave it"),
        )
        return None


def _restore(fs: HostFS, path: str, owner: int | None, lock_wait_s: float) -> RestoreReport | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if not _lock(fd, lock_wait_s):
            log.warning(
                "irq checkpoint busy %s",
                format_fields(path=path, waited_s=lock_wait_s, action="restore anyway"),
            )
        st = os.fstat(fd)
        if st.st_nlink == 0 or not _same_file(path, st):
            return None  # restored and removed (or replaced) while we waited
        text = os.read(fd, 1 << 22).decode("utf-8", "replace")
        try:
            data = parse_checkpoint(text)
        except CheckpointError as err:
            return _discard(path, str(err))
        if owner is not None and data.pid != owner:
            return None  # a newer daemon's own: it is alive, not ours to touch
        plan = plan_restore(
            data,
            boot_id=read_boot_id(fs),
            irqs=[irq for irq in data.originals if fs.exists(f"proc/irq/{irq}")],
            online_cpus=_online_cpus(fs),
        )
        if plan.other_boot:
            return _discard(path, "other boot", boot_id=data.boot_id, pid=data.pid)
        report = _apply(fs, path, data, plan)
        if _same_file(path, st):
            remove_file(path)
        return report
    finally:
        os.close(fd)  # drops the flock


def _online_cpus(fs: HostFS) -> frozenset[int] | None:
    text = fs.read_optional(ONLINE_CPUS_FILE)
    try:
        return None if text is None else parse_cpulist(text)
    except ValueError:
        return None


def _discard(path: str, reason: str, **fields: object) -> RestoreReport:
    log.warning(
        "irq checkpoint discarded %s",
        format_fields(path=path, reason=reason, **fields, action="remove, restore nothing"),
    )
    remove_file(path)
    return RestoreReport(path, discarded=reason)


def _apply(fs: HostFS, path: str, data: IrqCheckpointData, plan: RestorePlan) -> RestoreReport:
    misfit = misfit_fields(plan)
    if misfit is not None:
        log.warning("irq checkpoint misfit %s", format_fields(path=path, **misfit))
    binder = IrqBinder(fs)  # no checkpoint of its own: these writes are the restore
    restored: list[int] = []
    failed: list[tuple[int, str]] = []
    for irq, cpus in sorted(plan.writes.items()):
        try:
            # Unchanged (never moved: a kernel-managed IRQ refused our write)
            # needs no write, and a managed one would refuse this one too.
            if binder.read_affinity(irq) != cpus:
                binder.bind(irq, cpus)
        except KernelError as err:
            failed.append((irq, err.reason))
            log.warning(
                "irq restore failed %s",
                format_fields(irq=irq, cpus=format_cpulist(cpus), error=err, action="leave"),
            )
            continue
        restored.append(irq)
    log.warning(
        "irq checkpoint restored %s",
        format_fields(
            path=path,
            pid=data.pid,
            irqs=format_cpulist(restored) or None,
            failed=len(failed),
            action="originals back (the daemon that moved them ended unclean)",
        ),
    )
    return RestoreReport(path, tuple(restored), tuple(failed), None, plan, data.pid)
