"""Per-rank child cgroups: detect a writable subtree, create/update/remove (does I/O: cgroupfs).

Every path goes through `HostFS`. Layout (`<inst>` = "placement-supervisor"
plus an optional "-<suffix>", so parallel instances and tests never clash):

- cgroup v1: `sys/fs/cgroup/memory/<own memory path>/<inst>/<name>` only: no
  child cpusets. A v1 child cpuset must hold CPUs and mems (it takes no task
  until both are set) that are a subset of its parent's, and the kernel
  refuses (EBUSY) a parent write that would leave a child's outside the new
  set, even a child equal to its parent (kernel/cgroup/cpuset.c
  validate_change; tried on 6.18). So any per-rank cpuset blocks the plain
  shrink that the supervisor's owner makes (`docker update --cpuset-cpus`,
  `runc update`, the kubelet). The ranks stay in the supervisor's own cpuset,
  which the owner then shrinks freely (the kernel moves every task at once);
  each rank's CPUs are its threads' affinity and its memory the shim's
  memory policy plus the check loop's migrate_pages, and its memory cgroup
  still counts its pages per node (memory.numa_stat). Without a writable v1
  memory hierarchy there are no per-rank cgroups.
- cgroup v2: `<own>/<inst>/<name>`, with `cpuset` and `memory` enabled in the
  `cgroup.subtree_control` of `<own>` and `<inst>`, only when `<own>` is
  delegated (`supervisor.bind.cgroup_v2`: never the host's root, never a
  read-only mount). v2 allows no processes in a non-root cgroup that enables
  controllers for its children ("no internal process constraint",
  Documentation/admin-guide/cgroup-v2.rst 2-4-3), so the supervisor first
  moves itself into the leaf `<own>/<inst>/supervisor` (systemd's layout for
  `Delegate=yes`); in a container's own cgroup everything else there moves
  too. Other processes in a host cgroup make that fail (EBUSY): we then move
  back and run without cgroups. `<own>`'s resource files (cpuset.cpus,
  memory.max) stay its owner's. v2 migrates pages whenever `cpuset.mems`
  changes, and a child's cpuset never blocks its parent's write (the child's
  effective set is narrowed instead, cgroup-v2.rst 5-3).

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

from supervisor.bind.cgroup_v2 import decide_v2, read_v2_facts
from supervisor.cpulist import format_cpulist, parse_cpulist
from supervisor.errors import KernelError, translate_oserror
from supervisor.hostfs import HostFS
from supervisor.state import CgroupObservation
from supervisor.topology.cgroup import CGROUP_ROOT
from supervisor.topology.mountinfo import CgroupDir, map_cgroup_path, read_mounts

PREFIX = "placement-supervisor"
SUPERVISOR_LEAF = "supervisor"
CgroupVersion = Literal[1, 2]
# With the proc connector reporting forks, a rank cgroup's cgroup.procs is read
# every this many checks; between, an unchanged /proc/<pid>/cgroup says the
# process is still inside (CgroupManager._membership), and the tree keeper
# takes a reading this many checks old (trees.keeper).
MEMBERSHIP_READ_EVERY = 5


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
    cpuset_parent: str  # v1: the cpuset hierarchy's own dir (only read); v2: the own cgroup dir
    memory_parent: str | None  # v1: the memory hierarchy's own dir; v2: cpuset_parent or None
    own_path: str  # the supervisor's cgroup path as /proc/self/cgroup names it
    evict_self: bool = False  # v2, non-root: the supervisor moves into a leaf first
    evict_all: bool = False  # v2, the container's own cgroup: everything in it moves too

    @property
    def controllers(self) -> tuple[str, ...]:
        """The controllers of the per-process cgroups (v1: memory only, see above)."""
        if self.version == 1:
            return ("memory",)
        return ("cpuset", "memory") if self.memory_parent is not None else ("cpuset",)

    @property
    def rank_cpusets(self) -> bool:
        """Whether each process gets a cpuset of its own (v2 only)."""
        return self.version == 2


@dataclass(frozen=True, slots=True)
class ProcessCgroup:
    """One process's cgroup: `dirs` are the absolute paths the shim joins (`--cgroup`)."""

    name: str
    version: CgroupVersion
    cpuset_dir: str | None  # relative to the HostFS root; None on v1 (no child cpusets)
    memory_dir: str | None
    dirs: tuple[str, ...]

    @property
    def procs_dir(self) -> str:
        """The dir whose cgroup.procs lists the process (relative to the HostFS root)."""
        rel = self.cpuset_dir or self.memory_dir
        assert rel is not None  # a ProcessCgroup has at least one dir
        return rel

    @property
    def rels(self) -> tuple[str, ...]:
        """Its dirs relative to the HostFS root, one per hierarchy."""
        return tuple(dict.fromkeys(d for d in (self.cpuset_dir, self.memory_dir) if d))


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
        decision, why = decide_v2(read_v2_facts(fs, unified.path, read_mounts(fs)))
        if decision is None:
            return None, why
        memory = decision.own if decision.memory else None
        container = decision.owner == "container"
        evict = container or unified.path != "/"
        return CgroupSetup(2, decision.own, memory, unified.path, evict, container), why
    by_controller = {c: e for e in entries for c in e.controllers}
    cpuset_entry = by_controller.get("cpuset")
    if cpuset_entry is None:
        return None, "no cpuset controller: neither cgroup v2 nor a v1 cpuset hierarchy"
    cpuset_dir = _v1_dir(fs, cpuset_entry, "cpuset")
    if cpuset_dir is None or not fs.exists(f"{cpuset_dir}/cpuset.cpus"):
        return None, f"cgroup v1: cpuset hierarchy for {cpuset_entry.path} not found"
    memory_entry = by_controller.get("memory")
    memory_dir = None if memory_entry is None else _v1_dir(fs, memory_entry, "memory")
    if memory_dir is None or not fs.is_dir(memory_dir):
        return None, (
            "cgroup v1: no memory hierarchy (per-rank cpusets would block a shrink "
            "of the supervisor's own cpuset, so v1 uses memory cgroups only)"
        )
    if not _writable(fs, memory_dir):
        return None, f"cgroup v1: {fs.path(memory_dir)} is not writable"
    setup = CgroupSetup(1, cpuset_dir, memory_dir, cpuset_entry.path)
    return setup, f"cgroup v1 memory at {fs.path(memory_dir)} (cpuset {fs.path(cpuset_dir)})"


def detect_cgroup_setup(fs: HostFS) -> CgroupSetup | None:
    """The writable cgroup subtree of this process, or None (see `read_cgroup_setup` for why)."""
    return read_cgroup_setup(fs)[0]


@dataclass(slots=True)
class _Inside:
    """A cgroup.procs read found `pid` inside its cgroup; its /proc/<pid>/cgroup then."""

    pid: int
    text: str
    checks: int = 0  # checks confirmed by `text` alone since


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
        self._procs_read: dict[str, tuple[float, str]] = {}  # rel -> (monotonic, cgroup.procs)
        self._inside: dict[tuple[str, ...], _Inside] = {}
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self._prepared = False
        self._moved_self = False
        self._moved_others: list[int] = []

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
        parent = s.memory_parent if s.version == 1 else s.cpuset_parent
        return (f"{parent}/{self.instance}",)

    def prepare(self) -> None:
        """Create the instance dir (again, when someone removed it). Raises
        KernelError; `create` calls it."""
        if self._prepared and all(self.fs.is_dir(d) for d in self.instance_dirs):
            return
        if self.setup.version == 1:
            self._prepare_v1()
        else:
            self._prepare_v2()
        self._prepared = True

    def _prepare_v1(self) -> None:
        self._mkdir(self.instance_dirs[0])  # memory only: see the module docstring

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
                if s.evict_all:
                    self._evict_others(leaf)
            self._enable(s.cpuset_parent)
            self._enable(inst)
        except KernelError:
            self._undo_v2(inst, created)
            raise

    def _evict_others(self, leaf: str, rounds: int = 5) -> None:
        """Every other process in the container's cgroup into `leaf` too.

        The container's cgroup holds only the container's own processes (a
        wrapper shell, a `runc exec`): all of them go to the leaf, as moby's
        hack/dind does with /init and systemd in a container with init.scope,
        since one left behind makes the write to cgroup.subtree_control fail
        (EBUSY, "no internal process constraint", cgroup-v2.rst 2-4-3). Later
        execs are put in the init process's cgroup by the runtime when its own
        is busy (runc's exec joins the init's cgroup on EBUSY). A process can
        fork into the cgroup while we move: a few rounds, until it is empty.
        """
        own = self.setup.cpuset_parent
        for _ in range(rounds):
            pids = [p for p in self._read(f"{own}/cgroup.procs").split() if p.isdigit()]
            if not pids:
                return
            for pid in pids:
                try:
                    self.fs.write_text(f"{leaf}/cgroup.procs", pid)
                except ProcessLookupError:
                    continue  # exited meanwhile
                except OSError as err:
                    raise translate_oserror(self.fs.path(f"{leaf}/cgroup.procs"), err) from None
                self._moved_others.append(int(pid))

    def _undo_v2(self, inst: str, created: bool) -> None:
        s = self.setup
        for pid in self._moved_others:  # back where they were (best effort)
            with contextlib.suppress(OSError):
                self.fs.write_text(f"{s.cpuset_parent}/cgroup.procs", str(pid))
        self._moved_others = []
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
        for rel in self.instance_dirs:  # one
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
        pc = self.process_cgroup(name)
        made: list[str] = []
        try:
            for rel in pc.rels:
                if self._mkdir(rel):
                    made.append(rel)
            self.update(pc, cpus, mems)
        except KernelError:
            for rel in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(self.fs.path(rel))
            raise
        return pc

    def process_cgroup(self, name: str) -> ProcessCgroup:
        """Where the cgroup `name` lives (no I/O; `create` makes it)."""
        s = self.setup
        if s.version == 1:
            memory_dir = f"{s.memory_parent}/{self.instance}/{name}"
            return ProcessCgroup(name, 1, None, memory_dir, (self.fs.path(memory_dir),))
        cpuset_dir = f"{s.cpuset_parent}/{self.instance}/{name}"
        memory_dir_v2 = cpuset_dir if s.memory_parent else None
        return ProcessCgroup(name, 2, cpuset_dir, memory_dir_v2, (self.fs.path(cpuset_dir),))

    def update(self, pc: ProcessCgroup, cpus: Iterable[int], mems: Iterable[int]) -> None:
        """Set the cgroup's cpus and mems (pages of its tasks follow a mems change).

        No-op on v1 (no child cpusets: affinity and memory policy place the ranks)."""
        cpu_text, mem_text = format_cpulist(cpus), format_cpulist(mems)
        if not cpu_text or not mem_text:
            raise translate_oserror(
                self.fs.path(pc.procs_dir),
                OSError(errno.EINVAL, "a cgroup needs at least one CPU and one memory node"),
            )
        if pc.cpuset_dir is None:
            return
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
        for rel in pc.rels:
            self._rmdir(rel, timeout_s)

    def read_effective(self, pc: ProcessCgroup) -> tuple[frozenset[int], frozenset[int]]:
        """The CPUs and memory nodes the kernel grants the cgroup (after its ancestors);
        on v1 the supervisor's own cpuset's, which its processes share."""
        where, cpu_file, mem_file = (
            (self.setup.cpuset_parent, "cpuset.effective_cpus", "cpuset.effective_mems")
            if pc.cpuset_dir is None
            else (pc.cpuset_dir, "cpuset.cpus.effective", "cpuset.mems.effective")
        )
        cpus = parse_cpulist(self._read(f"{where}/{cpu_file}"))
        mems = parse_cpulist(self._read(f"{where}/{mem_file}"))
        return cpus, mems

    def read_numa_stat(self, pc: ProcessCgroup) -> dict[int, int]:
        """Allocated (anon + shmem, not file) bytes per node of the cgroup's memory.numa_stat.

        v1 counts pages, v2 bytes. {} when the cgroup has no memory controller.
        """
        if pc.memory_dir is None:
            return {}
        text = self._read(f"{pc.memory_dir}/memory.numa_stat")
        return parse_numa_stat(text, self.page_size if pc.version == 1 else 1)

    def observe(
        self, pc: ProcessCgroup, pid: int, *, membership_every: int = 1
    ) -> CgroupObservation:
        """The cgroup as it is now: dirs someone removed, its cpuset as written
        (v2), whether `pid` is still in it. Raises KernelError when unreadable.
        `membership_every`: the checks a /proc/<pid>/cgroup confirmation stands
        for; 1: every check reads cgroup.procs (the daemon's check loop passes
        MEMBERSHIP_READ_EVERY while the tree keeper's proc connector reports forks)."""
        missing: list[str] = []
        outside = False
        membership = self._membership(pc, pid, membership_every)
        if membership is not None:
            for rel in pc.rels:
                try:
                    text = self.fs.read_text(f"{rel}/cgroup.procs")
                except FileNotFoundError:
                    missing.append(self.fs.path(rel))
                    continue
                except OSError as err:
                    raise translate_oserror(self.fs.path(rel), err) from None
                self._procs_read[rel] = (time.monotonic(), text)
                outside = outside or str(pid) not in text.split()
            if not missing and not outside and membership:
                self._inside[pc.rels] = _Inside(pid, membership)
        cpus = mems = None
        if pc.cpuset_dir is not None and self.fs.path(pc.cpuset_dir) not in missing:
            try:
                cpus = tuple(sorted(parse_cpulist(self._read(f"{pc.cpuset_dir}/cpuset.cpus"))))
                mems = tuple(sorted(parse_cpulist(self._read(f"{pc.cpuset_dir}/cpuset.mems"))))
            except KernelError as err:
                if err.reason != "gone":
                    raise
                missing.append(self.fs.path(pc.cpuset_dir))  # removed between the reads
        return CgroupObservation(tuple(missing), cpus, mems, outside and not missing)

    def _membership(self, pc: ProcessCgroup, pid: int, every: int) -> str | None:
        """None when `pid`'s /proc/<pid>/cgroup reads as it did at a cgroup.procs
        read (fewer than `every` checks ago) that found it inside every
        dir: it is inside still, and no dir was removed (rmdir(2) of a cgroup with
        a process in it fails, EBUSY). Else that text ("" when unread): read the
        cgroup.procs files. Issue 17, item 6: a v1 cgroup.procs read builds and
        sorts a list of every thread (45 us hot for 101 threads, against 10)."""
        if every <= 1:
            return ""
        try:
            raw = self.fs.read_live(f"proc/{pid}/cgroup", 64 * 1024, f"pid {pid}")
        except KernelError:
            raw = None
        text = "" if raw is None else raw.decode("utf-8", "replace")
        last = self._inside.get(pc.rels)
        if last is None or last.pid != pid or last.text != text or not text:
            return text
        last.checks += 1  # at `every`, cgroup.procs again: the keeper's reading ages
        return text if last.checks >= every else None

    def repair(
        self, pc: ProcessCgroup, cpus: Iterable[int], mems: Iterable[int], pids: Iterable[int]
    ) -> None:
        """Make the cgroup as planned again: the instance dir and the process's dirs
        (re-made where someone removed them), its cpuset (v2), and `pids` back in
        (cgroup.procs moves a whole thread group, cgroups(7)). KernelError on failure."""
        self.prepare()
        for rel in pc.rels:
            self._mkdir(rel)
        self.update(pc, cpus, mems)
        for rel in pc.rels:
            for pid in pids:
                try:
                    self.fs.write_text(f"{rel}/cgroup.procs", str(pid))
                except ProcessLookupError:
                    continue  # exited meanwhile: its runner reports that
                except OSError as err:
                    raise translate_oserror(self.fs.path(f"{rel}/cgroup.procs"), err) from None

    def recent_procs(self, rel: str, max_age_s: float) -> list[int] | None:
        """The pids `observe` read in `rel`/cgroup.procs less than `max_age_s` ago, or
        None: the tree keeper takes them rather than read the file again (any thread)."""
        read = self._procs_read.get(rel)
        if read is None or time.monotonic() - read[0] >= max_age_s:
            return None
        return [int(word) for word in read[1].split() if word.isdigit()]

    def read_procs(self, pc: ProcessCgroup) -> list[int]:
        """The pids in the cgroup (cgroup.procs)."""
        text = self._read(f"{pc.procs_dir}/cgroup.procs")
        return [int(word) for word in text.split()]
