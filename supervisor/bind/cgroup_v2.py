"""Whether this process's cgroup v2 dir is a subtree delegated to it: the facts read
through HostFS (`read_v2_facts`) and the decision on them (`decide_v2`, pure).

Used by `supervisor.bind.cgroup.read_cgroup_setup`; what it allows is made there.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from supervisor.hostfs import HostFS
from supervisor.topology.cgroup import CGROUP_ROOT
from supervisor.topology.mountinfo import Mount, map_cgroup_path

# The inode of the initial cgroup namespace is a fixed constant
# (PROC_CGROUP_INIT_INO = 0xEFFFFFFB, include/linux/proc_ns.h), the same on
# every boot, so "cgroup:[4026531835]" in /proc/self/ns/cgroup means "not in a
# cgroup namespace" without reading another process's /proc/<pid>/ns (which a
# container's own pid namespace, or missing ptrace access, would hide anyway).
INIT_CGROUP_NS_INODE = 0xEFFFFFFB
Owner = Literal["host", "container"]


@dataclass(frozen=True, slots=True)
class V2Facts:
    """What the decision needs, as read (relative paths are relative to the HostFS root)."""

    path: str  # the "0::<path>" of /proc/self/cgroup
    mount: Mount | None  # the cgroup2 mount that shows it; None without mountinfo (fixtures)
    own: str | None  # the dir of `path`; None when no cgroup2 mount shows it
    shown: str  # `own` as a path for messages (under the HostFS root)
    is_root_cgroup: bool  # no cgroup.type in `own`: the host's root cgroup
    cgroupns: bool | None  # in a cgroup namespace (None: /proc/self/ns/cgroup unreadable)
    controllers: tuple[str, ...]  # own/cgroup.controllers
    writable: bool  # own, its cgroup.procs and cgroup.subtree_control writable (access(2))


@dataclass(frozen=True, slots=True)
class V2Decision:
    """Child cgroups go below `own`; `owner` says whose cgroup `own` is."""

    own: str
    owner: Owner  # "container": the runtime's cgroup, every process in it moves to the leaf
    memory: bool  # the memory controller is delegated too


def parse_ns_inode(link: str | None) -> int | None:
    """The inode of a /proc/<pid>/ns/<type> link ("cgroup:[4026531835]"), or None."""
    m = re.fullmatch(r"\w+:\[(\d+)\]", link or "")
    return int(m.group(1)) if m else None


def read_v2_facts(fs: HostFS, path: str, mounts: tuple[Mount, ...] | None) -> V2Facts:
    """The facts about cgroup v2 `path` in this mount namespace (reads only)."""
    own: str | None
    mapped = None if mounts is None else map_cgroup_path(mounts, (), path)
    if mapped is not None:
        own = mapped.rel
    elif mounts is None:
        # Fixture trees without mountinfo: a pure v2 host mounts at sys/fs/cgroup.
        own = (CGROUP_ROOT + path).rstrip("/")
    else:
        own = None
    inode = parse_ns_inode(fs.readlink("proc/self/ns/cgroup"))
    controllers: tuple[str, ...] = ()
    writable = False
    is_root = False
    if own is not None:
        controllers = tuple((fs.read_optional(f"{own}/cgroup.controllers") or "").split())
        # cgroup.type "exists on non-root cgroups" only (cgroup-v2.rst, Core Interface Files)
        is_root = path == "/" and not fs.exists(f"{own}/cgroup.type")
        # cgroup.procs too: it is what the supervisor writes to move the processes
        # (a fixture tree may leave it out)
        procs = f"{own}/cgroup.procs"
        writable = all(
            os.access(fs.path(rel), os.W_OK)
            for rel in (own, f"{own}/cgroup.subtree_control", procs)
            if rel != procs or fs.exists(procs)
        )
    return V2Facts(
        path=path,
        mount=None if mapped is None else mapped.mount,
        own=own,
        shown="" if own is None else fs.path(own),
        is_root_cgroup=is_root,
        cgroupns=None if inode is None else inode != INIT_CGROUP_NS_INODE,
        controllers=controllers,
        writable=writable,
    )


def _ns_word(facts: V2Facts) -> str:
    return {None: "unknown", True: "private", False: "initial"}[facts.cgroupns]


def decide_v2(facts: V2Facts) -> tuple[V2Decision | None, str]:
    """Whether child cgroups may be made below this process's v2 cgroup (pure): (decision,
    why) or (None, why not).

    Delegation is write access to a cgroup's dir and its cgroup.procs and
    cgroup.subtree_control, with the controllers listed in its
    cgroup.controllers (cgroup-v2.rst, "Model of Delegation"). Whoever
    delegated it keeps its resource files (cpuset.cpus, memory.max: they
    spend the parent's resources), so nothing here ever writes them: a
    container's runtime or kubelet goes on writing them, and v2 narrows the
    children's effective sets instead of refusing that write (cgroup-v2.rst
    5-3, "Cpuset"). Whether the controllers can really be enabled is only
    known by writing cgroup.subtree_control (EBUSY, EOPNOTSUPP): `CgroupManager.prepare`.
    """
    if facts.own is None:
        # In a cgroup namespace a cgroup2 mount made outside it shows a root
        # outside the namespace ("/.."); its mount point is not this process's
        # cgroup, and "/" + path there would be the host's cgroup of that name.
        return None, (
            f"cgroup v2: no cgroup2 mount shows {facts.path} (a mount from outside this "
            f"process's cgroup namespace, namespace={_ns_word(facts)}); nothing is delegated"
        )
    where = facts.shown
    if facts.is_root_cgroup:
        # The host's root (no cgroup.type), even inside a cgroup namespace whose
        # root it is: its subtree_control turns controllers on for the whole host.
        # The evidence is a file of the cgroup itself, not the namespace: being in
        # a namespace says nothing of where its root lies (`unshare --cgroup` run
        # in the root cgroup makes one whose "/" is the host's root), and
        # /proc/self/ns/cgroup against /proc/1/ns/cgroup agree in any container
        # with its own pid namespace (its PID 1 shares our namespace). The
        # namespace's inode is kept for the messages only.
        return None, (
            f"cgroup v2: {where} is the host's root cgroup; placement-supervisor never "
            "writes it: run it in a delegated cgroup (systemd Delegate=yes) or a container"
        )
    if facts.mount is not None and facts.mount.read_only:
        return None, f"cgroup v2: {where} is mounted read-only (not delegated by the runtime)"
    if "cpuset" not in facts.controllers:
        return None, (
            f"cgroup v2: cpuset is not delegated to {facts.path} "
            f"(cgroup.controllers: {' '.join(facts.controllers) or 'none'})"
        )
    if not facts.writable:
        return None, f"cgroup v2: {where} is not writable"
    # The container's own cgroup: the mount's root is this cgroup and it is shown at
    # the mount point. Under a cgroup namespace /proc/self/cgroup says "/" and the
    # mount root is "/" too (cgroup_namespaces(7)): that "/" is the namespace's
    # root, a non-root cgroup (it has cgroup.type, checked above). Without a
    # namespace a runtime bind-mounts the container's cgroup: the mount's root is
    # its host path. Either way every process living in it is the container's.
    container = facts.mount is not None and facts.own == facts.mount.mount_point.strip("/")
    owner: Owner = "container" if container else "host"
    decision = V2Decision(facts.own, owner, "memory" in facts.controllers)
    kind = "the container's cgroup" if container else "a delegated cgroup"
    return decision, f"cgroup v2 at {where} ({kind} {facts.path}, namespace={_ns_word(facts)})"
