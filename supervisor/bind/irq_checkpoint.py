"""The IRQ checkpoint: the original affinity of every IRQ we move, in a state file
(does I/O: the file itself with plain os calls; /proc/irq through HostFS and IrqBinder).

Written before the first IRQ write, so that after an unclean end (the daemon
and its guardian killed, a crash) the next one to look puts the host's own
affinities back instead of taking ours for the originals. The document and its
restore plan are pure (supervisor.bind.irq_checkpoint_data); here the file, the
host-wide lock its instances share, then `restore_checkpoint`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from supervisor.bind.irq import IrqBinder
from supervisor.bind.irq_checkpoint_data import (
    CheckpointError,
    IrqCheckpointData,
    RestorePlan,
    format_checkpoint,
    misfit_fields,
    parse_checkpoint,
    plan_restore,
)
from supervisor.cpulist import format_cpulist, parse_cpulist
from supervisor.errors import KernelError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields

log = logging.getLogger("placement_supervisor.irq_checkpoint")

# After a reboot the kernel has reset every IRQ's affinity: a checkpoint of
# another boot describes nothing on this one (proc(5), /proc/sys/kernel/random).
BOOT_ID_FILE = "proc/sys/kernel/random/boot_id"
ONLINE_CPUS_FILE = "sys/devices/system/cpu/online"
# A guardian restoring the same file holds its lock for the kill rounds
# (guardian.KILL_ROUNDS_S) plus the writes: wait a little longer than that.
LOCK_WAIT_S = 15.0
_LOCK_POLL_S = 0.02


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


class CheckpointUnwritable(OSError):
    """The checkpoint could not be written before an IRQ write: the IRQ is not moved."""


class IrqCheckpoint:
    """This daemon's checkpoint file: the originals of the IRQs it moved (thread-safe).

    `add` before an IRQ is first written (raises CheckpointUnwritable when the
    file cannot be written: an original kept in memory only is lost to a
    SIGKILL, so the IRQ must not move), `discard` once it is back; the file goes
    when nothing is left in it.

    The originals are the host's, not this instance's: every instance of one
    host keeps its file in the same state directory, and under one host-wide
    flock (`host_lock`: the directory's) an IRQ another instance's file already holds
    is recorded with that file's original (the first writer's read), and an
    IRQ a live instance still holds is not written back by the others
    (`held_by_others`): the last user restores.
    """

    def __init__(self, path: str, boot_id: str, pid: int | None = None) -> None:
        self.path = path
        self.boot_id = boot_id
        self.pid = os.getpid() if pid is None else pid
        self._originals: dict[int, frozenset[int]] = {}
        self._lock = threading.RLock()
        self._host_fd: int | None = None
        self._depth = 0
        self._warned = False

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """This object's lock and the host-wide one (reentrant: flock(2) is per open
        file, so a second open in this process would wait on the first)."""
        with self._lock:
            if self._depth == 0:
                # Best effort: a directory where the lock file cannot be made is one
                # where `add` cannot write either (and refuses), while a restore
                # must go on without it.
                self._host_fd = _host_lock_or_none(os.path.dirname(self.path) or ".")
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._host_fd is not None:
                    os.close(self._host_fd)  # drops the flock
                    self._host_fd = None

    def probe(self) -> str | None:
        """Why this checkpoint cannot be written now (its directory missing, read-only
        or full), or None: the host lock taken and a small file written, synced and
        removed beside it. Blocking; at start, before any IRQ is moved."""
        directory = os.path.dirname(self.path) or "."
        try:
            with self.locked():
                write_atomic(os.path.join(directory, f".probe-{self.pid}"), "{}\n")
                remove_file(os.path.join(directory, f".probe-{self.pid}"))
        except OSError as err:
            return f"{directory}: {err.strerror or err}"
        return None

    def held_by_others(self, irqs: Iterable[int]) -> dict[int, int]:
        """IRQ -> the pid of another live daemon whose checkpoint holds it (call
        under `locked`): not ours to write back while that one runs."""
        wanted = frozenset(irqs)
        out: dict[int, int] = {}
        for data in sibling_checkpoints(self.path, self.boot_id):
            if data.pid != self.pid and pid_alive(data.pid):
                for irq in wanted & data.originals.keys():
                    out.setdefault(irq, data.pid)
        return out

    def __repr__(self) -> str:
        return f"IrqCheckpoint({self.path!r}, irqs={sorted(self._originals)})"

    def __contains__(self, irq: object) -> bool:
        return irq in self._originals

    @property
    def originals(self) -> dict[int, frozenset[int]]:
        return dict(self._originals)

    def add(self, originals: Mapping[int, Iterable[int]]) -> dict[int, frozenset[int]]:
        """Save the IRQs not in it yet and return the host's original of each given
        IRQ: one already here keeps its first original, one another instance's file
        holds takes that file's (it read the IRQ before anyone moved it). Raises
        CheckpointUnwritable, keeping nothing new, when the file cannot be written."""
        with self.locked():
            new = {irq: frozenset(c) for irq, c in originals.items() if irq not in self._originals}
            if new:
                for data in sibling_checkpoints(self.path, self.boot_id):
                    for irq in new.keys() & data.originals.keys():
                        new[irq] = data.originals[irq]
                self._originals.update(new)
                try:
                    self._write()
                except OSError as err:
                    for irq in new:
                        del self._originals[irq]
                    raise CheckpointUnwritable(
                        err.errno, f"{self.path}: {err.strerror or err}"
                    ) from None
            return {irq: self._originals[irq] for irq in originals}

    def discard(self, irqs: Iterable[int]) -> None:
        """Forget IRQs that are back on their originals; remove the file when empty."""
        with self.locked():
            gone = [irq for irq in irqs if self._originals.pop(irq, None) is not None]
            if gone:
                self._save()

    def _write(self) -> None:
        if self._originals:
            data = IrqCheckpointData(self.boot_id, self.pid, dict(self._originals))
            write_atomic(self.path, format_checkpoint(data))
        else:
            remove_file(self.path)

    def _save(self) -> None:
        try:
            self._write()
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


CHECKPOINT_SUFFIX = ".irqs.json"


def host_lock(directory: str, wait_s: float = LOCK_WAIT_S) -> int:
    """flock(2) LOCK_EX on the state directory itself (every instance of the host
    keeps its checkpoint there; a directory takes flock as a file does, and no
    lock file is left behind); its fd (close it to unlock). Raises OSError when
    the directory cannot be opened."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if not _lock(fd, wait_s):
        log.warning(
            "irq host lock busy %s",
            format_fields(path=directory, waited_s=wait_s, action="go on"),
        )
    return fd


def sibling_checkpoints(path: str, boot_id: str) -> list[IrqCheckpointData]:
    """The other checkpoints of this boot in `path`'s directory (every instance's);
    one that cannot be read or parsed is skipped (its own daemon's start reports it)."""
    directory = os.path.dirname(path) or "."
    out: list[IrqCheckpointData] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        other = os.path.join(directory, name)
        if not name.endswith(CHECKPOINT_SUFFIX) or name.startswith(".") or other == path:
            continue
        try:
            with open(other, encoding="utf-8", errors="replace") as f:
                data = parse_checkpoint(f.read(1 << 22))
        except (OSError, CheckpointError):
            continue
        if data.boot_id == boot_id:
            out.append(data)
    return out


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (kill(2) with signal 0; EPERM: it does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        boot_id = read_boot_id(fs)
        if data.boot_id != boot_id:
            return _discard(path, "other boot", boot_id=data.boot_id, pid=data.pid)
        host = _host_lock_or_none(os.path.dirname(path) or ".")
        try:
            # The last user restores: an IRQ a live instance's checkpoint also holds
            # stays as it is (that one writes the host's original back at its end).
            data = _without_held(path, data)
            plan = plan_restore(
                data,
                boot_id=boot_id,
                irqs=[irq for irq in data.originals if fs.exists(f"proc/irq/{irq}")],
                online_cpus=_online_cpus(fs),
            )
            report = _apply(fs, path, data, plan)
            if _same_file(path, st):
                remove_file(path)
        finally:
            if host is not None:
                os.close(host)
        return report
    finally:
        os.close(fd)  # drops the flock


def _host_lock_or_none(directory: str) -> int | None:
    """The host-wide IRQ lock for a restore; None (restore anyway) when the
    directory cannot be opened."""
    try:
        return host_lock(directory)
    except OSError:
        return None


def _without_held(path: str, data: IrqCheckpointData) -> IrqCheckpointData:
    """`data` less the IRQs another live daemon's checkpoint holds, with one line."""
    held: dict[int, int] = {}
    for other in sibling_checkpoints(path, data.boot_id):
        if other.pid != data.pid and pid_alive(other.pid):
            for irq in data.originals.keys() & other.originals.keys():
                held.setdefault(irq, other.pid)
    if not held:
        return data
    log.info(
        "irq checkpoint shared %s",
        format_fields(
            path=path,
            irqs=format_cpulist(held),
            holders=",".join(str(pid) for pid in sorted(set(held.values()))),
            action="leave them to the last instance using them",
        ),
    )
    kept = {irq: cpus for irq, cpus in data.originals.items() if irq not in held}
    return IrqCheckpointData(data.boot_id, data.pid, MappingProxyType(kept))


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
