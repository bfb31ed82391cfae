"""Where this process's cgroups are mounted: /proc/self/mountinfo (pure parse; reads via HostFS).

/proc/self/cgroup names a cgroup path in its hierarchy (cgroups(7)); inside a
container that hierarchy is mounted with its root at the container's own
cgroup, so the path is found under the mount point only after the mount's
root (mountinfo field 4, proc(5)) is taken off it: "/ctr/x" in a mount of root
"/ctr" at /sys/fs/cgroup/cpuset is the dir /sys/fs/cgroup/cpuset/x. Under a
cgroup namespace /proc/self/cgroup shows "/" and the root is "/" as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.hostfs import HostFS

MOUNTINFO = "proc/self/mountinfo"


@dataclass(frozen=True, slots=True)
class Mount:
    """One line of mountinfo (proc(5)), the fields used here."""

    root: str  # the path of the mounted dir inside its filesystem (for cgroupfs: a cgroup path)
    mount_point: str  # where it is mounted, in this mount namespace
    fstype: str
    super_options: tuple[str, ...]
    read_only: bool  # the mount's own options say "ro"


@dataclass(frozen=True, slots=True)
class CgroupDir:
    """A cgroup path mapped onto this mount namespace."""

    rel: str  # the dir, relative to the HostFS root
    mount: Mount

    @property
    def is_mount_root(self) -> bool:
        """The dir is the mount point itself: the cgroup a container was given."""
        return self.rel == self.mount.mount_point.strip("/")


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash as octal escapes (\040).
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> tuple[Mount, ...]:
    """The mounts of a mountinfo file; a line without the " - " separator is skipped."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) < sep + 3:
            continue
        mounts.append(
            Mount(
                root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]),
                fstype=fields[sep + 1],
                super_options=tuple(fields[sep + 3].split(",")) if len(fields) > sep + 3 else (),
                read_only="ro" in fields[5].split(","),
            )
        )
    return tuple(mounts)


def _under(path: str, root: str) -> str | None:
    """`path` relative to `root` ("" for root itself), or None when it lies outside."""
    if root == "/":
        return path.strip("/")
    if path == root:
        return ""
    if path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")) + 1 :].strip("/")
    return None


def map_cgroup_path(
    mounts: Sequence[Mount], controllers: Sequence[str], path: str
) -> CgroupDir | None:
    """The dir of cgroup `path` of the hierarchy with `controllers` (() = cgroup2).

    Of the matching mounts whose root holds `path`, the one with the longest
    root wins (a bind mount of a sub-cgroup shows the most of it).
    """
    best: tuple[int, CgroupDir] | None = None
    for m in mounts:
        if controllers:
            if m.fstype != "cgroup" or not set(controllers) & set(m.super_options):
                continue
        elif m.fstype != "cgroup2":
            continue
        rest = _under(path or "/", m.root)
        if rest is None:
            continue
        point = m.mount_point.strip("/")
        rel = f"{point}/{rest}" if rest else point
        if best is None or len(m.root) > best[0]:
            best = (len(m.root), CgroupDir(rel, m))
    return None if best is None else best[1]


def read_mounts(fs: HostFS) -> tuple[Mount, ...] | None:
    """This process's mounts, or None when mountinfo cannot be read (a fixture without it).

    The text is read each call; it is parsed again only when it changed (a node
    agent maps each container's cgroup through it, every look)."""
    text = fs.read_optional(MOUNTINFO)
    if text is None:
        return None
    last = _PARSED.get(fs.root)
    if last is not None and last[0] == text:
        return last[1]
    mounts = parse_mountinfo(text)
    _PARSED[fs.root] = (text, mounts)
    return mounts


# The root read (the host's "/", a fixture tree) -> its last mountinfo text, parsed.
_PARSED: dict[str, tuple[str, tuple[Mount, ...]]] = {}
