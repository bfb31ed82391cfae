"""HostFS: the one seam between the supervisor and the host's /proc, /sys, /dev (file I/O).

Every path is relative to a root ("/" on a live host, a fixture or snapshot
directory in tests and `--root`). It does plain file I/O and nothing else;
parsing lives in `supervisor.topology`. With `record=True` it remembers every
file, directory listing and link it read, which is what `snapshot` copies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from supervisor.errors import TopologyError

_CHUNK = 1 << 16


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
        """The whole file; raises OSError (FileNotFoundError when missing).

        Raw os.open/os.read rather than open(): discovery reads thousands of
        tiny sysfs files and the text-layer setup is half the cost of each.
        Reads until EOF because procfs seq_files return a page at a time.
        """
        fd = os.open(self.path(rel), os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunk = os.read(fd, _CHUNK)
            if len(chunk) < _CHUNK and rel.startswith("sys/"):
                data = chunk  # sysfs attributes come whole in one read (one page)
            else:
                parts = [chunk]
                while chunk:
                    chunk = os.read(fd, _CHUNK)
                    parts.append(chunk)
                data = b"".join(parts)
        finally:
            os.close(fd)
        if self.log is not None:
            self.log.files.add(rel)
        return data.decode("utf-8", errors="replace")

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
