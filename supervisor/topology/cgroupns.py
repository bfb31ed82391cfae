"""Where this process's cgroup namespace is rooted in the host's cgroup tree (reads via HostFS).

Under a private cgroup namespace (containerd and CRI-O give each container one
on cgroup v2) /proc/<pid>/cgroup names another pod's cgroup relative to the
reader's namespace root: `0::/../../kubepods-burstable.slice/...`. The kernel
writes the host tree's mount root in /proc/self/mountinfo the same way
(`/../../..` for a namespace rooted three levels down; cgroup_show_path in
kernel/cgroup/cgroup.c), which gives the root's depth; the root is the cgroup at
that depth under which this process's own cgroup (/proc/self/cgroup) lists its
pid in cgroup.procs. Found once per hierarchy, checked with one read each pass,
found again when it no longer holds; `resolve_lines` (pure) maps paths onto it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from supervisor.hostfs import HostFS
from supervisor.topology.cgroup import PROC_CGROUP, parse_proc_cgroup
from supervisor.topology.model import CgroupLine
from supervisor.topology.mountinfo import MOUNTINFO, Mount, parse_mountinfo

# A hierarchy by its controllers as /proc/self/cgroup names them; () is cgroup2.
Hierarchy = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NamespaceRoot:
    """One hierarchy's namespace root on the host and where it was found."""

    root: str  # the root's host cgroup path ("/kubepods.slice/.../cri-containerd-x.scope")
    own_procs: str  # the cgroup.procs (HostFS-relative) that listed this process


def up_count(mount_root: str) -> int | None:
    """How many levels a cgroup mount's root field climbs above this namespace's
    root: 0 for "/", 3 for "/../../.."; None for any other root (a sub-cgroup
    mounted, which names no depth). Pure."""
    parts = [p for p in mount_root.split("/") if p]
    if all(p == ".." for p in parts):
        return len(parts)
    return None


def join_host_path(root: str, path: str) -> str | None:
    """`path`, as /proc/<pid>/cgroup shows it under a namespace rooted at host
    path `root`, as a host path; None when its ".." climb above the host's root
    (a path that cannot be the host's). Pure."""
    parts = [p for p in root.split("/") if p]
    for p in path.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(p)
    return "/" + "/".join(parts)


def resolve_lines(
    lines: Sequence[CgroupLine], roots: Mapping[Hierarchy, NamespaceRoot]
) -> tuple[CgroupLine, ...]:
    """`lines` with each path made a host path where its hierarchy's namespace
    root is known; a line of another hierarchy stays as it was. Pure."""
    out = []
    for line in lines:
        found = roots.get(line.controllers)
        host = None if found is None else join_host_path(found.root, line.path)
        out.append(line if host is None else CgroupLine(line.hierarchy, line.controllers, host))
    return tuple(out)


def _visible_mount(mounts: Sequence[Mount], controllers: Hierarchy) -> Mount | None:
    """The mount of the hierarchy `controllers` that a path lookup reaches: of
    several at one mount point (a DaemonSet mounts the host's tree over the
    container's own), the last mounted."""
    best = None
    for m in mounts:
        if controllers:
            if m.fstype != "cgroup" or not set(controllers) <= set(m.super_options):
                continue
        elif m.fstype != "cgroup2":
            continue
        best = m
    return best


def _lists_pid(fs: HostFS, procs: str, pid: int) -> bool:
    # iter_lines: a high-level cgroup's cgroup.procs holds every pid below it only
    # in v1, but either may be longer than read_text's cap.
    try:
        return any(line.strip() == str(pid) for line in fs.iter_lines(procs))
    except OSError:
        return False


def _dirs_at(fs: HostFS, top: str, depth: int) -> list[str]:
    """The cgroup dirs `depth` levels below `top`, relative to it, breadth first."""
    level = [""]
    for _ in range(depth):
        nxt = []
        for rel in level:
            base = f"{top}/{rel}" if rel else top
            nxt += [
                f"{rel}/{n}" if rel else n for n in fs.listdir(base) if fs.is_dir(f"{base}/{n}")
            ]
        level = nxt
    return level


def find_namespace_roots(fs: HostFS) -> dict[Hierarchy, NamespaceRoot]:
    """Each hierarchy whose visible mount reaches above this process's cgroup
    namespace (a root field of ".."s) and the host path of that namespace's root;
    {} outside a namespace, or when only the namespace's own tree is mounted
    (paths outside it cannot be read at all then)."""
    own_text = fs.read_optional(PROC_CGROUP)
    mounts_text = fs.read_optional(MOUNTINFO)
    link = fs.readlink("proc/self")
    if own_text is None or mounts_text is None or link is None or not link.isdigit():
        return {}
    pid = int(link)
    mounts = parse_mountinfo(mounts_text)
    roots: dict[Hierarchy, NamespaceRoot] = {}
    for line in parse_proc_cgroup(own_text):
        mount = _visible_mount(mounts, line.controllers)
        depth = None if mount is None else up_count(mount.root)
        own = [p for p in line.path.split("/") if p]
        if mount is None or not depth or ".." in own:
            continue
        top = mount.mount_point.strip("/")
        for cand in _dirs_at(fs, top, depth):
            procs = "/".join([top, cand, *own, "cgroup.procs"])
            if _lists_pid(fs, procs, pid):
                roots[line.controllers] = NamespaceRoot("/" + cand, procs)
                break
    return roots


@dataclass(slots=True)
class NamespaceRoots:
    """The namespace roots the agent resolves paths with (mutable; one per agent).

    `current` finds them at the first call and again when /proc/self/cgroup or
    mountinfo changed, or a root's cgroup.procs no longer lists this process (the
    agent moved, its pod's cgroup re-made): one read per hierarchy a pass."""

    key: tuple[str | None, str | None] | None = None
    roots: dict[Hierarchy, NamespaceRoot] = field(default_factory=dict)
    finds: int = 0  # full searches, for tests

    def current(self, fs: HostFS) -> dict[Hierarchy, NamespaceRoot]:
        key = (fs.read_optional(PROC_CGROUP), fs.read_optional(MOUNTINFO))
        link = fs.readlink("proc/self")
        pid = int(link) if link is not None and link.isdigit() else -1
        holds = all(_lists_pid(fs, r.own_procs, pid) for r in self.roots.values())
        if key != self.key or not holds:
            self.roots = find_namespace_roots(fs)
            self.key = key
            self.finds += 1
        return self.roots


# One cache per root read (the host "/" in a daemon; a fixture tree in tests).
_ROOTS: dict[str, NamespaceRoots] = {}


def host_lines(fs: HostFS, lines: Sequence[CgroupLine]) -> tuple[CgroupLine, ...]:
    """Another process's /proc/<pid>/cgroup `lines` as host paths: unchanged unless
    one climbs out of this process's cgroup namespace ("/../.."), as every other
    pod's does from a container with a private cgroup namespace (containerd and
    CRI-O on cgroup v2); those are resolved against the namespace's roots on the
    host (found once per root read, re-checked at each call with one read per
    hierarchy; a scan of many processes takes `current_roots` once itself)."""
    if not any(line.path.startswith("/..") for line in lines):
        return tuple(lines)
    return resolve_lines(lines, current_roots(fs))


def current_roots(fs: HostFS) -> dict[Hierarchy, NamespaceRoot]:
    """This process's cgroup namespace roots on the host (cached per root read)."""
    return _ROOTS.setdefault(fs.root, NamespaceRoots()).current(fs)
