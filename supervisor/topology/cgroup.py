"""The allowed CPUs and memory nodes: affinity ∩ cgroup cpuset (reads via HostFS).

The supervisor's own, or in attach mode an `EngineScope`'s: the cpuset of the
engine's cgroup, which bounds what its threads may be bound to whatever the
supervisor's own affinity is (sched_setaffinity(2) on another task checks the
target's cpuset, not the caller's).

Affinity comes from /proc/self/status (proc(5): Cpus_allowed_list,
Mems_allowed_list). The cpuset comes from the cgroup named in
/proc/self/cgroup (cgroups(7)): cgroup2 `cpuset.{cpus,mems}.effective`
(Documentation/admin-guide/cgroup-v2.rst) or the v1 cpuset hierarchy's
`cpuset.effective_{cpus,mems}` (cgroup-v1/cpusets.rst). On a hybrid host the
hierarchy that has the cpuset controller wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from supervisor.cpulist import format_cpulist
from supervisor.errors import TopologyError
from supervisor.hostfs import HostFS
from supervisor.topology.cpus import parse_list_text
from supervisor.topology.model import Allowed, CgroupLine, EngineScope
from supervisor.topology.mountinfo import MOUNTINFO, map_cgroup_path, read_mounts

STATUS = "proc/self/status"
PROC_CGROUP = "proc/self/cgroup"
CGROUP_ROOT = "sys/fs/cgroup"  # where the cgroup hierarchies are mounted
V1_CPUSET_ROOT = f"{CGROUP_ROOT}/cpuset"


@dataclass(frozen=True, slots=True)
class Cpuset:
    """The cpuset that confines the process, and where it was found."""

    version: Literal[1, 2]
    path: str  # cgroup path of the directory holding the files ("/" = hierarchy root)
    cpus: frozenset[int] | None  # None: the hierarchy has no cpuset files at all
    mems: frozenset[int] | None
    files: tuple[str, ...]  # host-relative files read, for error messages


def parse_status_allowed(text: str, rel: str = STATUS) -> tuple[frozenset[int], frozenset[int]]:
    """Cpus_allowed_list and Mems_allowed_list of a status file.

    Finds the two lines instead of splitting all ~55: the check loop parses
    its own status every pass."""
    result = []
    padded = "\n" + text
    for key in ("Cpus_allowed_list", "Mems_allowed_list"):
        at = padded.find(f"\n{key}:")
        if at < 0:
            raise TopologyError(f"no {key} line in {rel}", rel)
        start = at + len(key) + 2
        end = padded.find("\n", start)
        value = padded[start:] if end < 0 else padded[start:end]
        result.append(parse_list_text(value.strip(), rel, key))
    return result[0], result[1]


def parse_proc_cgroup(text: str, rel: str = PROC_CGROUP) -> tuple[CgroupLine, ...]:
    lines: list[CgroupLine] = []
    for raw in text.splitlines():
        if not raw.strip():
            continue
        parts = raw.split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit():
            raise TopologyError(f"garbled line in {rel}: {raw!r}", rel)
        controllers = tuple(c for c in parts[1].split(",") if c)
        lines.append(CgroupLine(int(parts[0]), controllers, parts[2]))
    return tuple(lines)


def _ancestors(path: str) -> list[str]:
    """ "/a/b" -> ["a/b", "a", ""]: the cgroup and each parent up to the root.

    Walking up also handles a container without a cgroup namespace, whose
    /proc/self/cgroup names a path that does not exist inside its own mount.
    """
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _find_cpuset(
    fs: HostFS, version: Literal[1, 2], mount: str, path: str, names: tuple[str, str]
) -> Cpuset:
    for rel in _ancestors(path):
        d = f"{mount}/{rel}" if rel else mount
        found = _read_files(fs, version, "/" + rel, (f"{d}/{names[0]}", f"{d}/{names[1]}"))
        if found is not None:
            return found
    return Cpuset(version, path or "/", None, None, ())


def _read_files(
    fs: HostFS, version: Literal[1, 2], path: str, files: tuple[str, str]
) -> Cpuset | None:
    """The cpuset whose CPU and memory lists are `files`; None when the CPU list
    cannot be read (absent: not this cgroup's, or gone). Absent mems are None."""
    cpus_rel, mems_rel = files
    cpus_text = fs.read_optional(cpus_rel)
    if cpus_text is None:
        return None
    cpus = parse_list_text(cpus_text, cpus_rel, "cpuset CPU list")
    mems_text = fs.read_optional(mems_rel)
    mems = None if mems_text is None else parse_list_text(mems_text, mems_rel, "cpuset mems")
    return Cpuset(version, path, cpus, mems, files)


def _read_mapped(fs: HostFS, line: CgroupLine) -> Cpuset | None:
    """The cpuset of `line` in the dir /proc/self/mountinfo maps its path to (a
    container's cgroupfs is mounted with its own cgroup as root); None when
    mountinfo is absent or maps nothing, or the dir has no cpuset files."""
    mounts = read_mounts(fs)
    mapped = None if mounts is None else map_cgroup_path(mounts, line.controllers, line.path)
    if mapped is None:
        return None
    version: Literal[1, 2] = 1 if line.controllers else 2
    names = (
        ("cpuset.effective_cpus", "cpuset.effective_mems")
        if version == 1
        else ("cpuset.cpus.effective", "cpuset.mems.effective")
    )
    # None: the walk up (older kernels' names, or a v2 cgroup without cpuset).
    files = (f"{mapped.rel}/{names[0]}", f"{mapped.rel}/{names[1]}")
    return _read_files(fs, version, line.path or "/", files)


def read_cpuset(fs: HostFS) -> Cpuset | None:
    """The cpuset confining this process, or None when /proc/self/cgroup is absent."""
    text = fs.read_optional(PROC_CGROUP)
    if text is None:
        return None
    return cpuset_of(fs, parse_proc_cgroup(text))


def cpuset_of(fs: HostFS, lines: Sequence[CgroupLine]) -> Cpuset | None:
    """The cpuset of the process whose /proc/<pid>/cgroup is `lines`, as this
    process's mount namespace shows it (a node agent reads another container's);
    None when no line is a cpuset's or cgroup2's."""
    for line in lines:
        if "cpuset" in line.controllers:
            mapped = _read_mapped(fs, line)
            if mapped is not None:
                return mapped
            cs = _find_cpuset(
                fs, 1, V1_CPUSET_ROOT, line.path, ("cpuset.effective_cpus", "cpuset.effective_mems")
            )
            if cs.cpus is None:
                # Without cpuset.cpu_exclusive support or on old kernels only
                # the configured (not effective) masks exist.
                cs = _find_cpuset(fs, 1, V1_CPUSET_ROOT, line.path, ("cpuset.cpus", "cpuset.mems"))
            return cs
    for line in lines:
        if line.hierarchy == 0 and not line.controllers:
            mapped = _read_mapped(fs, line)
            if mapped is not None:
                return mapped
            # Pure cgroup2 mounts at sys/fs/cgroup; hybrid hosts at sys/fs/cgroup/unified.
            mount = (
                CGROUP_ROOT
                if fs.read_optional(f"{CGROUP_ROOT}/cgroup.controllers") is not None
                else f"{CGROUP_ROOT}/unified"
            )
            return _find_cpuset(
                fs, 2, mount, line.path, ("cpuset.cpus.effective", "cpuset.mems.effective")
            )
    return None


def read_allowed(
    fs: HostFS,
    online: frozenset[int],
    node_ids: frozenset[int],
    scope: EngineScope | None = None,
) -> Allowed:
    """Allowed CPUs and nodes; an empty result is a TopologyError naming the files."""
    if scope is not None and scope.lines is not None:
        return _read_engine_allowed(fs, online, node_ids, scope, scope.lines)
    status = fs.read_required(STATUS, "allowed CPUs and nodes")
    aff_cpus, aff_mems = parse_status_allowed(status)
    cpuset = read_cpuset(fs)
    cpus = aff_cpus & online
    mems = aff_mems & node_ids
    sources = [STATUS, f"online CPUs ({format_cpulist(online)})"]
    if cpuset is not None and cpuset.cpus is not None:
        cpus &= cpuset.cpus
        sources.append(f"{cpuset.files[0]} ({format_cpulist(cpuset.cpus)})")
    if cpuset is not None and cpuset.mems is not None:
        mems &= cpuset.mems
    if scope is not None and scope.cpus is not None:
        cpus &= scope.cpus
        sources.append(f"engine.attach.cpus ({format_cpulist(scope.cpus)})")
    if not cpus:
        raise TopologyError(
            f"no allowed CPUs: Cpus_allowed_list {format_cpulist(aff_cpus)} in {STATUS}"
            f" ∩ {' ∩ '.join(sources[1:])} is empty",
            cpuset.files[0] if cpuset is not None and cpuset.files else STATUS,
        )
    if not mems:
        raise TopologyError(
            f"no allowed memory nodes: Mems_allowed_list {format_cpulist(aff_mems)} in {STATUS}"
            f" ∩ online nodes {format_cpulist(node_ids)} is empty",
            STATUS,
        )
    allowed = Allowed(
        cpus=cpus,
        mems=mems,
        cgroup_path=None if cpuset is None else cpuset.path,
        cgroup_version=None if cpuset is None else cpuset.version,
        scope=scope,
    )
    return allowed


def _read_engine_allowed(
    fs: HostFS,
    online: frozenset[int],
    node_ids: frozenset[int],
    scope: EngineScope,
    lines: tuple[CgroupLine, ...],
) -> Allowed:
    """The engine's cgroup's cpuset ∩ the online CPUs ∩ `scope.cpus`, its mems ∩ the
    nodes. The supervisor's own affinity plays no part: binding another process's
    threads needs only that they be allowed the CPUs (kernel/sched/core.c
    __sched_setaffinity intersects with the target's cpuset)."""
    engine = cpuset_of(fs, lines)
    if engine is None or engine.cpus is None:
        where = ", ".join(f"{x.hierarchy}:{','.join(x.controllers)}:{x.path}" for x in lines)
        raise TopologyError(f"the engine's cgroup ({where}) has no readable cpuset", PROC_CGROUP)
    cpus = engine.cpus & online
    if scope.cpus is not None:
        cpus &= scope.cpus
    if not cpus:
        given = "" if scope.cpus is None else f" ∩ engine.attach.cpus {format_cpulist(scope.cpus)}"
        raise TopologyError(
            f"no allowed CPUs: the engine's cgroup {engine.path} has CPUs "
            f"{format_cpulist(engine.cpus)} ({engine.files[0]}){given}"
            f" ∩ online CPUs {format_cpulist(online)} is empty",
            engine.files[0],
        )
    if engine.mems is None:
        mems = parse_status_allowed(fs.read_required(STATUS, "allowed memory nodes"))[1]
    else:
        mems = engine.mems
    mems &= node_ids
    if not mems:
        raise TopologyError(
            f"no allowed memory nodes: the engine's cgroup {engine.path} has mems "
            f"{format_cpulist(engine.mems or ())} ∩ online nodes "
            f"{format_cpulist(node_ids)} is empty",
            engine.files[1] if len(engine.files) > 1 else STATUS,
        )
    return Allowed(cpus, mems, engine.path, engine.version, scope=scope)


# The cached read re-resolves at least this often even when nothing it keys on
# changed: a v2 parent that starts delegating cpuset gives a cgroup its own
# files without changing /proc/self/cgroup or mountinfo.
CPUSET_RESOLVE_EVERY = 60


@dataclass(slots=True)
class CpusetCache:
    """Where `read_cpuset_cached` last found the cpuset files (mutable; one per reader)."""

    key: tuple[str | None, str | None] | None = None  # /proc/self/cgroup, mountinfo texts
    found: Cpuset | None = None
    reads: int = 0
    resolves: int = field(default=0, compare=False)  # full resolutions (for tests)


def read_cpuset_cached(
    fs: HostFS, cache: CpusetCache, lines: tuple[CgroupLine, ...] | None = None
) -> Cpuset | None:
    """`read_cpuset`, resolving the files to read only when /proc/self/cgroup or
    /proc/self/mountinfo changed, a cached file could not be read, or every
    CPUSET_RESOLVE_EVERY reads; otherwise two small reads of the files found
    last time. The resolution (a mountinfo parse and a walk up the hierarchy)
    was ~3/4 of the check loop's read of its allowed set. With `lines` (an attached
    engine's cgroup, fixed for the daemon's life) that cgroup's cpuset instead."""
    own = fs.read_optional(PROC_CGROUP) if lines is None else repr(lines)
    key = (own, fs.read_optional(MOUNTINFO))
    cache.reads += 1
    found = cache.found
    if key == cache.key and cache.reads % CPUSET_RESOLVE_EVERY != 0:
        if found is None or not found.files:
            return found
        cpus_rel, mems_rel = found.files
        fresh = _read_files(fs, found.version, found.path, (cpus_rel, mems_rel))
        if fresh is not None:
            return fresh
    # Read after the key: a change in between leaves the key stale, and the next
    # read resolves again.
    cache.found = found = read_cpuset(fs) if lines is None else cpuset_of(fs, lines)
    cache.key = key
    cache.resolves += 1
    return found
