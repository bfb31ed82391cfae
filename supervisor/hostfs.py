"""HostFS: the one seam between the supervisor and the host's /proc, /sys, /dev (file I/O).

Every path is relative to a root ("/" on a live host, a fixture or snapshot
directory in tests and `--root`). It does plain file I/O and nothing else;
parsing lives in `supervisor.topology`. With `record=True` it remembers every
file, directory listing and link it read, which is what `snapshot` copies.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from supervisor.errors import TopologyError, translate_oserror

_CHUNK = 1 << 16
# Caps per file kind. A sysfs attribute is one page (PAGE_SIZE, 64 KiB at
# most); procfs status-like files are a few KiB. The files that grow with the
# host or a process: /proc/interrupts (a column per CPU, a line per IRQ) and a
# process's numa_maps (a line per mapping). Reading past a cap is a garbled
# tree, not a reason to allocate without bound.
MAX_FILE_BYTES = 1 << 20
MAX_LARGE_FILE_BYTES = 256 << 20
# cgroupfs's lists of members grow with the cgroup: 8 bytes a pid, up to pid_max
# (4M): 32 MiB.
_LARGE_FILES = (
    "proc/interrupts",
    "/numa_maps",
    "/smaps",
    "/maps",
    "/cgroup.procs",
    "/cgroup.threads",
    "/tasks",
)
# Under sys/ but no sysfs: cgroupfs files are seq_files (a page or so a read, until
# EOF), as are procfs's. Only a sysfs attribute comes whole in its first read.
_SEQ_FILE_DIRS = ("sys/fs/cgroup/", "sys/kernel/debug/", "sys/kernel/tracing/")


def max_bytes_for(rel: str) -> int:
    """The read cap for `rel` (pure)."""
    return MAX_LARGE_FILE_BYTES if rel.endswith(_LARGE_FILES) else MAX_FILE_BYTES


def is_sysfs_attribute(rel: str) -> bool:
    """True when `rel` (relative to the root) is a sysfs attribute, whole in one read
    (pure). Everything else, cgroupfs under sys/fs/cgroup included, is read to EOF:
    a cgroup.procs of 5,000 pids is 30 KB, and its first read(2) returns one page."""
    return rel.startswith("sys/") and not rel.startswith(_SEQ_FILE_DIRS)


class SpecialFileError(TopologyError):
    """A file that must be a plain file is a FIFO, device, socket or directory, or
    larger than its cap: the tree is garbled (exit 3), never a hang or a MemoryError."""


def read_regular_file(path: str, max_bytes: int, *, sysfs: bool = False) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes`.

    Opened O_NONBLOCK so a FIFO cannot block the open (fifo(7)), then checked
    with fstat on the open fd (no race with a rename): only S_ISREG is read,
    so /dev/zero or /dev/urandom behind a link never stream. Raises OSError as
    the kernel returned it, SpecialFileError for the rest, naming `path`.
    """
    return read_regular_file_stat(path, max_bytes, sysfs=sysfs)[0]


def read_regular_file_stat(
    path: str, max_bytes: int, *, sysfs: bool = False
) -> tuple[bytes, os.stat_result]:
    """`read_regular_file`, with the fstat of the very file read (its mode, owner)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecialFileError(f"{path}: {_kind(st.st_mode)}, not a regular file", path)
        chunk = os.read(fd, _CHUNK)
        if len(chunk) < _CHUNK and sysfs:
            return chunk, st  # sysfs attributes come whole in one read (one page)
        parts = [chunk]
        total = len(chunk)
        while chunk:
            if total > max_bytes:
                raise SpecialFileError(f"{path}: larger than {max_bytes} bytes", path)
            chunk = os.read(fd, _CHUNK)
            parts.append(chunk)
            total += len(chunk)
        return b"".join(parts), st
    finally:
        os.close(fd)


def _raise_unless_gone(err: OSError, what: str) -> None:
    """Nothing when a process's or thread's file failed because it is gone
    (ENOENT, ESRCH: the caller reads that as None); any other failure raised as a
    KernelError naming `what`."""
    if err.errno in (errno.ENOENT, errno.ESRCH):
        return
    raise translate_oserror(what, err) from None


def _chunks(fd: int, what: str) -> Iterator[bytes]:
    try:
        while True:
            try:
                chunk = os.read(fd, _CHUNK)
            except OSError as err:
                _raise_unless_gone(err, what)
                return  # exited while read: what was read is all there is
            if not chunk:
                return
            yield chunk
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "a special file"


@dataclass(slots=True)
class ReadLog:
    """What one HostFS read: relative paths of files, listed dirs and links."""

    files: set[str] = field(default_factory=set)
    dirs: set[str] = field(default_factory=set)
    links: set[str] = field(default_factory=set)


class HostFS:
    """Reads (and, for IRQs and cgroups, writes) host files under `root`."""

    __slots__ = ("log", "root")

    def __init__(self, root: str = "/", *, record: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.log: ReadLog | None = ReadLog() if record else None

    def __repr__(self) -> str:
        return f"HostFS({self.root!r})"

    @property
    def is_live(self) -> bool:
        """True when this is the running host (root "/"): pids and tids are real."""
        return self.root == "/"

    def path(self, rel: str) -> str:
        """Absolute path of `rel` ("sys/devices/system/cpu/online") under the root."""
        return os.path.join(self.root, rel.lstrip("/"))

    # -- reads -------------------------------------------------------------

    def read_text(self, rel: str) -> str:
        """The whole file; raises OSError (FileNotFoundError when missing), and
        SpecialFileError (exit 3, naming the file) when it is no regular file
        or is larger than its cap (`max_bytes_for`).

        Raw os.open/os.read rather than open(): discovery reads thousands of
        tiny sysfs files and the text-layer setup is half the cost of each.
        Reads until EOF because procfs and cgroupfs seq_files return a page at a
        time; only a sysfs attribute (`is_sysfs_attribute`) is taken from one read.
        """
        data = read_regular_file(self.path(rel), max_bytes_for(rel), sysfs=is_sysfs_attribute(rel))
        if self.log is not None:
            self.log.files.add(rel)
        return data.decode("utf-8", errors="replace")

    def read_live(self, rel: str, max_bytes: int, what: str) -> bytes | None:
        """One read of a small /proc file of a process or thread (`comm`, `stat`);
        None when that process or thread is gone (ENOENT, ESRCH), any other
        failure as a KernelError naming `what` ("tid 4242").

        os.open/os.read rather than read_text: this runs for every thread on
        every check, and half the cost of a text-mode open() is Python's I/O stack.
        """
        try:
            fd = os.open(self.path(rel), os.O_RDONLY | os.O_CLOEXEC)
            try:
                return os.read(fd, max_bytes)
            finally:
                os.close(fd)
        except OSError as err:
            _raise_unless_gone(err, what)
            return None

    def read_head(self, rel: str, max_bytes: int, what: str) -> bytes | None:
        """At most the first `max_bytes` of a /proc file of a live process (its
        cmdline, say: legal up to ARG_MAX, megabytes); None when the process is
        gone (ENOENT, ESRCH), any other failure a KernelError naming `what`.
        Never more than `max_bytes` is read, however big the file."""
        parts: list[bytes] = []
        left = max_bytes
        try:
            fd = os.open(self.path(rel), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                while left > 0:
                    chunk = os.read(fd, min(left, _CHUNK))
                    if not chunk:
                        break
                    parts.append(chunk)
                    left -= len(chunk)
            finally:
                os.close(fd)
        except OSError as err:
            _raise_unless_gone(err, what)
            return None
        return b"".join(parts)

    def stream(self, rel: str, what: str) -> Iterator[bytes] | None:
        """The file in chunks, for a scan that stops early (a named variable in a
        process's environ, which may be megabytes); None when the process is gone.

        The file is opened at once (so None means gone now) and closed when the
        iterator is exhausted or dropped. Read errors are KernelErrors naming `what`."""
        try:
            fd = os.open(self.path(rel), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as err:
            _raise_unless_gone(err, what)
            return None
        return _chunks(fd, what)

    def iter_lines(self, rel: str) -> Iterator[str]:
        """The lines of a file, read a chunk at a time with no cap, each without its newline.

        For the procfs tables that grow with the host's sockets (/proc/<pid>/net/tcp
        holds every socket of the namespace, TIME_WAIT too: 150 bytes each) and
        whose caller keeps only a few rows. Only a regular file is read, as in
        `read_text`; raises OSError as the kernel returned it.
        """
        path = self.path(rel)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SpecialFileError(f"{path}: {_kind(st.st_mode)}, not a regular file", path)
            if self.log is not None:
                self.log.files.add(rel)
            rest = b""
            while chunk := os.read(fd, _CHUNK):
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop()
                for line in lines:
                    yield line.decode("utf-8", errors="replace")
            if rest:
                yield rest.decode("utf-8", errors="replace")
        finally:
            os.close(fd)

    def read_optional(self, rel: str) -> str | None:
        """The whole file, or None when it does not exist or cannot be read."""
        try:
            return self.read_text(rel)
        except OSError:
            return None

    def read_required(self, rel: str, what: str) -> str:
        """The whole file, or a TopologyError naming the file and what it holds."""
        try:
            return self.read_text(rel)
        except OSError as err:
            raise TopologyError(
                f"cannot read {what} from {self.path(rel)}: {err.strerror or err}", rel
            ) from None

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def is_dir(self, rel: str) -> bool:
        return os.path.isdir(self.path(rel))

    def listdir(self, rel: str) -> list[str]:
        """Sorted entries of a directory; [] when it does not exist."""
        try:
            names = sorted(os.listdir(self.path(rel)))
        except OSError:
            return []
        if self.log is not None:
            self.log.dirs.add(rel)
        return names

    def listdir_or_raise(self, rel: str) -> list[str]:
        """Sorted entries of a directory; raises OSError as the kernel returned it
        (for /proc/<pid>/fd, where EACCES and ENOENT mean different things)."""
        names = sorted(os.listdir(self.path(rel)))
        if self.log is not None:
            self.log.dirs.add(rel)
        return names

    def char_device(self, rel: str) -> tuple[int, int] | None:
        """(major, minor) of the character device `rel` is or points to
        (stat(2) follows a /proc/<pid>/fd link to the open file), else None."""
        try:
            st = os.stat(self.path(rel))
        except OSError:
            return None
        if not stat.S_ISCHR(st.st_mode):
            return None
        return os.major(st.st_rdev), os.minor(st.st_rdev)

    def readlink(self, rel: str) -> str | None:
        """The target of a symbolic link as written, or None when not a link."""
        try:
            target = os.readlink(self.path(rel))
        except OSError:
            return None
        if self.log is not None:
            self.log.links.add(rel)
        return target

    # -- writes (IRQ affinity, cgroup files) --------------------------------

    def write_text(self, rel: str, text: str) -> None:
        """Write `text` in one write(2), as sysfs/procfs/cgroupfs files expect.

        Raises OSError as the kernel returned it; callers translate it with
        `supervisor.errors.translate_oserror`.
        """
        fd = os.open(self.path(rel), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
