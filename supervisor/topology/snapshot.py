"""`snapshot OUT`: copy every file discovery reads into a plain host tree (does file I/O).

Discovery runs once through a recording HostFS; then each file it read is
copied (contents as plain files), each directory it listed gets one empty
placeholder per entry (so listings match), and each link it read is
recreated with the same target. Symbolic links on the way to a recorded path
(/sys/bus/pci/devices/<bdf>, /sys/class/net/<if>, /proc/self) are recreated
too, with their real directories behind them, so `read_topology(HostFS(OUT))`
sees the same tree.
"""

from __future__ import annotations

import os
import shutil

from supervisor.errors import ConfigError
from supervisor.hostfs import HostFS, max_bytes_for, read_regular_file
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions

_MAX_LINK_DEPTH = 40  # as the kernel's MAXSYMLINKS


class _Mirror:
    """Builds the output tree; paths are relative to the roots, "/"-separated."""

    def __init__(self, src_root: str, out_dir: str) -> None:
        self.src = os.path.abspath(src_root)
        self.out = os.path.abspath(out_dir)

    def _link(self, rel: str, target: str) -> None:
        dst = os.path.join(self.out, rel)
        if os.path.lexists(dst):
            return
        if os.path.isabs(target):
            # An absolute target means "under the host root": make it relative
            # so the snapshot never points outside itself.
            target = os.path.relpath(
                os.path.join(self.out, target.lstrip("/")), os.path.dirname(dst)
            )
        os.symlink(target, dst)

    def real_dir(self, rel: str, depth: int = 0) -> str:
        """Create directory `rel` in OUT as it is in the source, recreating any
        symlink on the way; return its real (link-free) relative path."""
        if depth > _MAX_LINK_DEPTH:
            raise OSError(f"too many levels of symbolic links at {rel}")
        cur = ""
        for comp in (p for p in rel.split("/") if p and p != "."):
            nxt = f"{cur}/{comp}" if cur else comp
            src = os.path.join(self.src, nxt)
            if os.path.islink(src):
                target = os.readlink(src)
                self._link(nxt, target)
                joined = (
                    target.lstrip("/")
                    if os.path.isabs(target)
                    else os.path.normpath(os.path.join(cur, target))
                )
                if joined.startswith(".."):
                    raise OSError(f"{src} points outside the root: {target}")
                cur = self.real_dir(joined, depth + 1)
            else:
                os.makedirs(os.path.join(self.out, nxt), exist_ok=True)
                cur = nxt
        return cur

    def copy_file(self, rel: str) -> bool:
        parent = self.real_dir(os.path.dirname(rel))
        try:
            data = read_regular_file(os.path.join(self.src, rel), max_bytes_for(rel))
        except OSError:
            return False  # vanished since discovery read it (a process's /proc entry)
        dst = os.path.join(self.out, parent, os.path.basename(rel))
        with open(dst, "wb") as f:
            f.write(data)
        return True

    def copy_link(self, rel: str) -> None:
        parent = self.real_dir(os.path.dirname(rel))
        try:
            target = os.readlink(os.path.join(self.src, rel))
        except OSError:
            return
        self._link(f"{parent}/{os.path.basename(rel)}" if parent else os.path.basename(rel), target)

    def fill_listing(self, rel: str) -> None:
        real = self.real_dir(rel)
        try:
            names = os.listdir(os.path.join(self.src, rel))
        except OSError:
            return
        for name in names:
            dst = os.path.join(self.out, real, name)
            if os.path.lexists(dst):
                continue
            if os.path.isdir(os.path.join(self.src, rel, name)):
                os.mkdir(dst)
            else:
                open(dst, "wb").close()  # an empty placeholder


def take_snapshot(src_root: str, out_dir: str, options: DiscoveryOptions) -> int:
    """Discover the host at `src_root` and copy what was read into `out_dir`.

    Returns the number of files copied. Refuses an existing non-empty
    `out_dir` (ConfigError) so nothing is ever half-overwritten.
    """
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConfigError(f"snapshot: {out_dir} exists and is not an empty directory")
    fs = HostFS(src_root, record=True)
    read_topology(fs, options)
    log = fs.log
    assert log is not None
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"snapshot: cannot create {out_dir}: {err.strerror or err}") from None
    mirror = _Mirror(src_root, out_dir)
    try:
        # Files and links first: they lay down the real directories and the
        # symlinks on the way; placeholders only fill what is left.
        copied = sum(1 for rel in sorted(log.files) if mirror.copy_file(rel))
        for rel in sorted(log.links):
            mirror.copy_link(rel)
        for rel in sorted(log.dirs):
            mirror.fill_listing(rel)
    except OSError as err:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise ConfigError(f"snapshot: cannot write {out_dir}: {err}") from None
    return copied
