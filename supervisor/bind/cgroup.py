"""Per-rank child cgroups: detect a writable subtree, create/update/remove (does I/O: cgroupfs).

Every path goes through `HostFS`. Layout (`<inst>` = "placement-supervisor"
plus an optional "-<suffix>", so parallel instances and tests never clash):

- cgroup v1: `sys/fs/cgroup/cpuset/<own cpuset path>/<inst>/<name>` and
  `sys/fs/cgroup/memory/<own memory path>/<inst>/<name>`; the shim joins both.
  A v1 cpuset takes no task until `cpuset.mems` and `cpuset.cpus` are set, and
  moves a task's pages when its mems change only with `cpuset.memory_migrate`=1
  (Documentation/admin-guide/cgroup-v1/cpusets.rst 1.4, 2.1).
- cgroup v2: `<own>/<inst>/<name>`, with `cpuset` and `memory` enabled in the
  `cgroup.subtree_control` of `<own>` and `<inst>`. v2 allows no processes in
  a non-root cgroup that enables controllers for its children ("no internal
  process constraint", Documentation/admin-guide/cgroup-v2.rst 2-4-3), so when
  `<own>` is not the root the supervisor first moves itself into the leaf
  `<own>/<inst>/supervisor`: the layout systemd documents for a service with
  `Delegate=yes`. Other processes in `<own>` make that fail (EBUSY): we then
  move back and run without cgroups. v2 migrates pages whenever
  `cpuset.mems` changes; there is no memory_migrate switch.

A failure here never stops a worker: callers catch `KernelError`, count it
(target "cgroup") and run the worker with affinity and memory policy only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from supervisor.cpulist import format_cpulist, parse_cpulist
from supervisor.errors import KernelError, translate_oserror
from supervisor.hostfs import HostFS
from supervisor.topology.mountinfo import CgroupDir, map_cgroup_path, read_mounts

PREFIX = "placement-supervisor"
CGROUP_ROOT = "sys/fs/cgroup"
SUPERVISOR_LEAF = "supervisor"
CgroupVersion = Literal[1, 2]


@dataclass(frozen=True, slots=True)
class CgroupEntry:
    """One line of /proc/<pid>/cgroup: "hierarchy-id:controllers:path"."""

    hierarchy: int
    controllers: tuple[str, ...]  # () for the v2 unified line "0::/path"
    path: str


@dataclass(frozen=True, slots=True)
class CgroupSetup:
    """Where this supervisor may create child cgroups (relative to the HostFS root)."""

    version: CgroupVersion
    cpuset_parent: str  # v1: the cpuset hierarchy's own dir; v2: the own cgroup dir
    memory_parent: str | None  # v1: the memory hierarchy's own dir; v2: cpuset_parent or None
    own_path: str  # the supervisor's cgroup path as /proc/self/cgroup names it
    evict_self: bool = False  # v2, non-root: the supervisor moves into a leaf first

    @property
    def controllers(self) -> tuple[str, ...]:
        return ("cpuset", "memory") if self.memory_parent is not None else ("cpuset",)


@dataclass(frozen=True, slots=True)
class ProcessCgroup:
    """One process's cgroup: `dirs` are the absolute paths the shim joins (`--cgroup`)."""

    name: str
    version: CgroupVersion
    cpuset_dir: str  # relative to the HostFS root
    memory_dir: str | None
    dirs: tuple[str, ...]


def parse_proc_cgroup(text: str) -> list[CgroupEntry]:
    """Parse /proc/<pid>/cgroup (cgroups(7)); skips malformed lines."""
    entries: list[CgroupEntry] = []
    for line in text.splitlines():
        hier, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep1 and sep2) or not hier.isdigit():
            continue
        names = tuple(c for c in controllers.split(",") if c)
        entries.append(CgroupEntry(int(hier), names, path or "/"))
    return entries


def parse_numa_stat(text: str, unit_bytes: int) -> dict[int, int]:
    """Allocated (not file) bytes per node from memory.numa_stat.

    v2 writes "anon N0=<bytes> N1=<bytes>" (unit_bytes=1) and counts shmem
    apart in a `shmem` line; v1 writes "anon=<pages> N0=<pages>" (unit_bytes
    = page size), whose anon LRU already holds shmem. So: v1 `anon`, v2
    `anon` + `shmem`, the memory the process allocated (heap, stacks, shared
    anonymous and pinned buffers). `file` is page cache other processes share
    and the check loop must not tug between nodes; v1's hierarchical_* lines
    would count children twice.
    """
    result: dict[int, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].partition("=")[0] not in ("anon", "shmem"):
            continue
        for item in fields[1:]:
            key, sep, value = item.partition("=")
            if sep and key.startswith("N") and key[1:].isdigit() and value.isdigit():
                node = int(key[1:])
                result[node] = result.get(node, 0) + int(value) * unit_bytes
    return result


def _writable(fs: HostFS, rel: str) -> bool:
    return os.access(fs.path(rel), os.W_OK)


def _mapped(fs: HostFS, controllers: tuple[str, ...], path: str) -> CgroupDir | None:
    """The dir of cgroup `path` through /proc/self/mountinfo (a container's cgroupfs
    is mounted with its own cgroup as the root); None without mountinfo."""
    mounts = read_mounts(fs)
    return None if mounts is None else map_cgroup_path(mounts, controllers, path)


def _v1_dir(fs: HostFS, entry: CgroupEntry, controller: str) -> str | None:
    mapped = _mapped(fs, entry.controllers, entry.path)
    if mapped is not None:
        return mapped.rel
    # Without mountinfo (fixture trees): a v1 hierarchy is mounted at
    # sys/fs/cgroup/<controller> or, co-mounted, at sys/fs/cgroup/<controllers joined by ",">.
    for mount in (",".join(entry.controllers), controller):
        base = f"{CGROUP_ROOT}/{mount}"
        if fs.is_dir(base):
            return base + entry.path.rstrip("/")
    return None


def read_cgroup_setup(fs: HostFS) -> tuple[CgroupSetup | None, str]:
    """Find a writable cgroup subtree for per-process cgroups: (setup, why) or (None, why not)."""
    text = fs.read_optional("proc/self/cgroup")
    if text is None:
        return None, "cannot read proc/self/cgroup"
    entries = parse_proc_cgroup(text)
    unified = next((e for e in entries if e.hierarchy == 0 and not e.controllers), None)
    if fs.exists(f"{CGROUP_ROOT}/cgroup.controllers") and unified is not None:
        mapped = _mapped(fs, (), unified.path)
        own = mapped.rel if mapped is not None else (CGROUP_ROOT + unified.path).rstrip("/")
        if mapped is not None and mapped.is_mount_root and mapped.mount.root != "/":
            # A container's own cgroup, mounted as its cgroupfs root: it belongs to
            # the runtime (or the kubelet), which writes its cpuset; enabling
            # controllers in it, or moving ourselves below it, would take it over.
            return None, (
                f"cgroup v2: {fs.path(own)} is the container's own cgroup "
                f"({mapped.mount.root}); no subtree is delegated below it"
            )
        available = (fs.read_optional(f"{own}/cgroup.controllers") or "").split()
        if "cpuset" not in available:
            return None, (
                f"cgroup v2: cpuset is not delegated to {unified.path} "
                f"(cgroup.controllers: {' '.join(available) or 'none'})"
            )
        if not _writable(fs, own) or not _writable(fs, f"{own}/cgroup.subtree_control"):
            return None, f"cgroup v2: {fs.path(own)} is not writable"
        memory = own if "memory" in available else None
        setup = CgroupSetup(2, own, memory, unified.path, evict_self=unified.path != "/")
        return setup, f"cgroup v2 at {fs.path(own)}"
    by_controller = {c: e for e in entries for c in e.controllers}
    cpuset_entry = by_controller.get("cpuset")
    if cpuset_entry is None:
        return None, "no cpuset controller: neither cgroup v2 nor a v1 cpuset hierarchy"
    cpuset_dir = _v1_dir(fs, cpuset_entry, "cpuset")
    if cpuset_dir is None or not fs.exists(f"{cpuset_dir}/cpuset.cpus"):
        return None, f"cgroup v1: cpuset hierarchy for {cpuset_entry.path} not found"
    if not _writable(fs, cpuset_dir):
        return None, f"cgroup v1: {fs.path(cpuset_dir)} is not writable"
    memory_dir: str | None = None
    memory_entry = by_controller.get("memory")
    if memory_entry is not None:
        candidate = _v1_dir(fs, memory_entry, "memory")
        if candidate is not None and fs.is_dir(candidate) and _writable(fs, candidate):
            memory_dir = candidate
    setup = CgroupSetup(1, cpuset_dir, memory_dir, cpuset_entry.path)
    return setup, f"cgroup v1 at {fs.path(cpuset_dir)}" + (
        f" and {fs.path(memory_dir)}" if memory_dir else " (no memory hierarchy)"
    )


def detect_cgroup_setup(fs: HostFS) -> CgroupSetup | None:
    """The writable cgroup subtree of this process, or None (see `read_cgroup_setup` for why)."""
    return read_cgroup_setup(fs)[0]


class CgroupManager:
    """Creates, updates and removes per-process cgroups under one instance dir."""

    def __init__(
        self,
        fs: HostFS,
        setup: CgroupSetup,
        *,
        suffix: str = "",
        page_size: int | None = None,
    ) -> None:
        if "/" in suffix or suffix in (".", ".."):
            raise ValueError(f"cgroup suffix must be a plain name, got {suffix!r}")
        self.fs = fs
        self.setup = setup
        self.instance = f"{PREFIX}-{suffix}" if suffix else PREFIX
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self._prepared = False
        self._moved_self = False

    def __repr__(self) -> str:
        return f"CgroupManager({self.fs!r}, v{self.setup.version}, {self.instance!r})"

    # -- low-level, every OSError translated with the file as target ----------

    def _write(self, rel: str, text: str) -> None:
        try:
            self.fs.write_text(rel, text)
        except OSError as err:
            raise translate_oserror(self.fs.path(rel), err) from None

    def _read(self, rel: str) -> str:
        try:
            return self.fs.read_text(rel)
        except OSError as err:
            raise translate_oserror(self.fs.path(rel), err) from None

    def _mkdir(self, rel: str) -> bool:
        """Create a cgroup dir; False when it already existed (a leftover is reused)."""
        try:
            os.mkdir(self.fs.path(rel))
        except FileExistsError:
            return False
        except OSError as err:
            raise translate_oserror(self.fs.path(rel), err) from None
        return True

    def _rmdir(self, rel: str, timeout_s: float) -> None:
        """rmdir a cgroup, retrying while it is busy: a process that just exited
        stays a member until it is reaped, and v2 takes a moment to let go."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(self.fs.path(rel))
                return
            except FileNotFoundError:
                return
            except OSError as err:
                if err.errno != errno.EBUSY or time.monotonic() >= deadline:
                    raise translate_oserror(self.fs.path(rel), err) from None
            time.sleep(0.01)  # polling with a deadline, not synchronisation

    def _enable(self, rel: str) -> None:
        wanted = " ".join(f"+{c}" for c in self.setup.controllers)
        try:
            self.fs.write_text(f"{rel}/cgroup.subtree_control", wanted)
        except OSError as err:
            if err.errno == errno.EBUSY:
                err = OSError(
                    errno.EBUSY,
                    "cgroup holds processes, and cgroup v2 allows none in a cgroup that "
                    "enables controllers for its children; give the supervisor its own "
                    "delegated cgroup (systemd Delegate=yes)",
                )
            raise translate_oserror(self.fs.path(f"{rel}/cgroup.subtree_control"), err) from None

    # -- the instance dir -------------------------------------------------------

    @property
    def instance_dirs(self) -> tuple[str, ...]:
        s = self.setup
        dirs = [f"{s.cpuset_parent}/{self.instance}"]
        if s.version == 1 and s.memory_parent is not None:
            dirs.append(f"{s.memory_parent}/{self.instance}")
        return tuple(dirs)

    def prepare(self) -> None:
        """Create the instance dir (once). Raises KernelError; `create` calls it."""
        if self._prepared:
            return
        if self.setup.version == 1:
            self._prepare_v1()
        else:
            self._prepare_v2()
        self._prepared = True

    def _prepare_v1(self) -> None:
        s = self.setup
        inst = f"{s.cpuset_parent}/{self.instance}"
        self._mkdir(inst)
        # A new v1 cpuset starts with empty cpus and mems: give the instance its
        # parent's, so that each rank's subset is valid (mems first, as tasks
        # can only join once both are set).
        self._write(f"{inst}/cpuset.mems", self._read(f"{s.cpuset_parent}/cpuset.mems").strip())
        self._write(f"{inst}/cpuset.cpus", self._read(f"{s.cpuset_parent}/cpuset.cpus").strip())
        if s.memory_parent is not None:
            self._mkdir(f"{s.memory_parent}/{self.instance}")

    def _prepare_v2(self) -> None:
        s = self.setup
        inst = f"{s.cpuset_parent}/{self.instance}"
        created = self._mkdir(inst)
        try:
            if s.evict_self:
                leaf = f"{inst}/{SUPERVISOR_LEAF}"
                self._mkdir(leaf)
                self._write(f"{leaf}/cgroup.procs", str(os.getpid()))
                self._moved_self = True
            self._enable(s.cpuset_parent)
            self._enable(inst)
        except KernelError:
            self._undo_v2(inst, created)
            raise

    def _undo_v2(self, inst: str, created: bool) -> None:
        s = self.setup
        if self._moved_self:
            try:
                self.fs.write_text(f"{s.cpuset_parent}/cgroup.procs", str(os.getpid()))
                self._moved_self = False
            except OSError:
                pass
        for rel in (f"{inst}/{SUPERVISOR_LEAF}", inst if created else None):
            if rel is not None:
                with contextlib.suppress(OSError):
                    os.rmdir(self.fs.path(rel))

    def close(self, timeout_s: float = 1.0) -> None:
        """Remove the instance dir once the process cgroups are gone (best effort).

        When the supervisor moved itself into `<inst>/supervisor` (v2, non-root),
        it stays there: moving back would need the parent's controllers turned
        off again, and the process is about to exit anyway (systemd removes a
        delegated subtree when the service stops).
        """
        if not self._prepared or self._moved_self:
            return
        for rel in self.instance_dirs:
            with contextlib.suppress(KernelError):
                self._rmdir(rel, timeout_s)
        self._prepared = False

    # -- per-process cgroups ------------------------------------------------------

    def create(self, name: str, cpus: Iterable[int], mems: Iterable[int]) -> ProcessCgroup:
        """Create (or reuse) the cgroup `name` with `cpus` and `mems`; KernelError on failure.

        Nothing is left half-made: on failure the dirs this call created are removed.
        """
        if not name or "/" in name or name in (".", "..", SUPERVISOR_LEAF):
            raise ValueError(f"bad cgroup name {name!r}")
        self.prepare()
        s = self.setup
        cpuset_dir = f"{s.cpuset_parent}/{self.instance}/{name}"
        memory_dir: str | None
        if s.version == 1:
            memory_dir = f"{s.memory_parent}/{self.instance}/{name}" if s.memory_parent else None
        else:
            memory_dir = cpuset_dir if s.memory_parent else None
        made: list[str] = []
        try:
            if self._mkdir(cpuset_dir):
                made.append(cpuset_dir)
            if memory_dir is not None and memory_dir != cpuset_dir and self._mkdir(memory_dir):
                made.append(memory_dir)
            pc = ProcessCgroup(
                name,
                s.version,
                cpuset_dir,
                memory_dir,
                tuple(self.fs.path(d) for d in dict.fromkeys([cpuset_dir, memory_dir]) if d),
            )
            if s.version == 1:
                # Pages follow a change of cpuset.mems only with memory_migrate set.
                self._write(f"{cpuset_dir}/cpuset.memory_migrate", "1")
            self.update(pc, cpus, mems)
        except KernelError:
            for rel in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(self.fs.path(rel))
            raise
        return pc

    def update(self, pc: ProcessCgroup, cpus: Iterable[int], mems: Iterable[int]) -> None:
        """Set the cgroup's cpus and mems (pages of its tasks follow a mems change)."""
        cpu_text, mem_text = format_cpulist(cpus), format_cpulist(mems)
        if not cpu_text or not mem_text:
            raise translate_oserror(
                self.fs.path(pc.cpuset_dir),
                OSError(errno.EINVAL, "a cgroup needs at least one CPU and one memory node"),
            )
        # Mems first: a v1 cpuset with CPUs but no mems takes no task, and a
        # mems change then migrates pages while the old CPUs still run them.
        self._write(f"{pc.cpuset_dir}/cpuset.mems", mem_text)
        self._write(f"{pc.cpuset_dir}/cpuset.cpus", cpu_text)

    def join(self, pc: ProcessCgroup, pid: int) -> None:
        """Move process `pid`, all of its threads (cgroups(7)), into the cgroup; every
        dir is tried, the first refusal raised (KernelError) after."""
        first: KernelError | None = None
        for rel in dict.fromkeys([pc.cpuset_dir, pc.memory_dir]):
            if rel is None:
                continue
            try:
                self._write(f"{rel}/cgroup.procs", str(pid))
            except KernelError as err:
                first = first or err
        if first is not None:
            raise first

    def remove(self, pc: ProcessCgroup, timeout_s: float = 2.0) -> None:
        """rmdir the cgroup after its processes exited (and were reaped); retries while busy."""
        for rel in dict.fromkeys([pc.cpuset_dir, pc.memory_dir]):
            if rel is not None:
                self._rmdir(rel, timeout_s)

    def read_effective(self, pc: ProcessCgroup) -> tuple[frozenset[int], frozenset[int]]:
        """The CPUs and memory nodes the kernel grants the cgroup (after its ancestors)."""
        if self.setup.version == 1:
            cpu_file, mem_file = "cpuset.effective_cpus", "cpuset.effective_mems"
        else:
            cpu_file, mem_file = "cpuset.cpus.effective", "cpuset.mems.effective"
        cpus = parse_cpulist(self._read(f"{pc.cpuset_dir}/{cpu_file}"))
        mems = parse_cpulist(self._read(f"{pc.cpuset_dir}/{mem_file}"))
        return cpus, mems

    def read_numa_stat(self, pc: ProcessCgroup) -> dict[int, int]:
        """Allocated (anon + shmem, not file) bytes per node of the cgroup's memory.numa_stat.

        v1 counts pages, v2 bytes. {} when the cgroup has no memory controller.
        """
        if pc.memory_dir is None:
            return {}
        text = self._read(f"{pc.memory_dir}/memory.numa_stat")
        return parse_numa_stat(text, self.page_size if pc.version == 1 else 1)

    def read_procs(self, pc: ProcessCgroup) -> list[int]:
        """The pids in the cgroup (cgroup.procs)."""
        text = self._read(f"{pc.cpuset_dir}/cgroup.procs")
        return [int(word) for word in text.split()]
