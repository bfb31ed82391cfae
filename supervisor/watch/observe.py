"""Observe live placement: threads, memory by node, IRQs, allowed CPUs (I/O via HostFS).

`read_*` functions read through a `HostFS` (so fixture trees work); on the live
host (`fs.is_live`) thread affinity comes from sched_getaffinity(2), one
syscall per thread. `parse_*` helpers are pure. `ThreadScanner` is the cheap
per-check reader the daemon keeps per process; `observe_process` assembles a
`state.Observation`. A thread or process that vanishes mid-scan is skipped,
never an error.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Literal

from supervisor.cpulist import parse_cpulist
from supervisor.errors import Gone, TopologyError, translate_oserror
from supervisor.hostfs import HostFS
from supervisor.plan.keys import ProcessKind, ThreadRole
from supervisor.plan.placement import Slot
from supervisor.plan.threads import LiveThread, RoleMatcher
from supervisor.procfs.files import list_tids, parse_status_thread
from supervisor.procfs.identity import ThreadId, read_thread_start
from supervisor.procfs.numa_maps import read_numa_maps
from supervisor.state import IrqObservation, Observation, ThreadObservation
from supervisor.topology.cgroup import (
    PROC_CGROUP,
    STATUS,
    CpusetCache,
    cpuset_of,
    parse_status_allowed,
    read_cpuset,
    read_cpuset_cached,
)
from supervisor.topology.model import EngineScope

ThreadReadMethod = Literal["auto", "syscall", "status"]
_GONE = (errno.ESRCH, errno.ENOENT)


# -- threads -----------------------------------------------------------------


def _read_comm(fs: HostFS, pid: int, tid: int) -> str | None:
    raw = fs.read_live(f"proc/{pid}/task/{tid}/comm", 64, f"tid {tid}")
    return None if raw is None else raw.decode("utf-8", "replace").rstrip("\n")


def _affinity(tid: int) -> tuple[int, ...] | None:
    try:
        return tuple(sorted(os.sched_getaffinity(tid)))
    except OSError as err:
        if err.errno in _GONE:
            return None
        raise translate_oserror(f"tid {tid}", err) from None


def read_threads(fs: HostFS, pid: int, method: ThreadReadMethod = "auto") -> list[LiveThread]:
    """Every thread of `pid` with its comm and allowed CPUs, in tid order.

    "syscall" reads each thread's comm file and calls sched_getaffinity(tid)
    (live host only); "status" parses each thread's status file (works on a
    fixture tree). "auto" takes "syscall" on the live host: it measured 3.3x
    cheaper (tests/bench/check_bench.py); for the check loop `ThreadScanner`
    is another ~13x cheaper. sched_getaffinity reports the allowed CPUs that
    are active (cpus_mask & cpu_active_mask), status all allowed CPUs; they
    differ only while a CPU is hot-unplugged. A gone process gives [].
    """
    if method == "auto":
        method = "syscall" if fs.is_live else "status"
    if method == "syscall" and not fs.is_live:
        raise ValueError(f"{fs!r}: the syscall method needs the live host")
    out: list[LiveThread] = []
    for tid in list_tids(fs, pid):
        if method == "syscall":
            name = _read_comm(fs, pid, tid)
            cpus = _affinity(tid) if name is not None else None
            if name is None or cpus is None:
                continue
            out.append(LiveThread(tid, name, cpus))
            continue
        try:
            text = fs.read_text(f"proc/{pid}/task/{tid}/status")
        except OSError as err:
            if err.errno in _GONE:
                continue
            raise translate_oserror(f"tid {tid}", err) from None
        try:
            name, cpus = parse_status_thread(text)
        except ValueError:
            continue  # a task torn down while its status was generated
        out.append(LiveThread(tid, name, cpus))
    return out


class _Known:
    """What a ThreadScanner remembers of one thread between scans."""

    __slots__ = ("cpus", "id", "live", "matcher", "observed", "scans")

    def __init__(self) -> None:
        self.scans = 0
        self.id: ThreadId | None = None  # its start time (stat field 22), read when first seen
        self.cpus: set[int] | None = None  # as sched_getaffinity returned it
        self.live: LiveThread | None = None
        self.observed: ThreadObservation | None = None  # built from `live` by `matcher`
        self.matcher: RoleMatcher | None = None


class _Steady:
    """A scan with every thread settled: what `ThreadScanner._steady_observe` compares."""

    __slots__ = ("cpus", "matcher", "observed", "tids")

    def __init__(
        self,
        matcher: RoleMatcher,
        observed: tuple[ThreadObservation, ...],
        tids: list[int],
        cpus: list[set[int]],
    ) -> None:
        self.matcher = matcher
        self.observed = observed
        self.tids = tids
        self.cpus = cpus


class ThreadScanner:
    """Reads one process's threads once per check, at close to syscall cost.

    Per scan it stats /proc/<pid>/task (whose link count is 2 + the number of
    threads, fs/proc/base.c proc_task_getattr) and lists it only when that
    count changed, a known thread vanished, or every `relist_every` scans;
    then one sched_getaffinity(2) per thread. Names (comm) are read for a
    thread's first `young_scans` scans (a pool thread names itself just after
    it starts) and for all threads every `rename_every` scans, so a later
    rename shows within that many checks. A thread whose CPUs and name did
    not change keeps its `LiveThread` (and `ThreadObservation`) object, which
    is what keeps a 4800-thread check near the syscall floor. On a fixture
    tree it falls back to `read_threads`. Keep one per process; make a new
    one when the process is restarted. With `member` its observations carry
    the pid (a tree member's threads, listed with its owner's).

    The steady state (no listing or renaming due, the same thread count, every
    thread past its young scans and on the CPUs it had) is one stat, one
    sched_getaffinity per thread in a comprehension and one list compare, and
    `observe` returns the very tuple it returned last time: the check loop's
    per-thread decisions are then skipped by identity (watch.decide). That
    made the 8 x 100-thread scan ~3x cheaper than the per-thread bookkeeping
    (issue 17, item 6; tests/bench/drift_bench.py).
    """

    __slots__ = (
        "_known",
        "_nlink",
        "_scan",
        "_steady",
        "fs",
        "member",
        "pid",
        "relist_every",
        "rename_every",
        "young_scans",
    )

    def __init__(
        self,
        fs: HostFS,
        pid: int,
        *,
        relist_every: int = 10,
        rename_every: int = 60,
        young_scans: int = 3,
        member: bool = False,
    ) -> None:
        if min(relist_every, rename_every, young_scans) < 1:
            raise ValueError("relist_every, rename_every and young_scans must be >= 1")
        self.fs = fs
        self.pid = pid
        self.relist_every = relist_every
        self.rename_every = rename_every
        self.young_scans = young_scans
        self.member = member
        self._known: dict[int, _Known] = {}
        self._nlink = -1
        self._scan = 0
        self._steady: _Steady | None = None

    def scan(self) -> list[LiveThread]:
        """The process's threads now, in tid order; [] when it is gone."""
        if not self.fs.is_live:
            return read_threads(self.fs, self.pid, "status")
        self._steady = None  # what this scan updates, the next observe builds afresh
        return [entry.live for entry in self._scan_entries() if entry.live is not None]

    def observe(self, matcher: RoleMatcher) -> tuple[ThreadObservation, ...]:
        """`scan()` as `ThreadObservation`s with roles from `matcher`."""
        pid = self.pid if self.member else None
        if not self.fs.is_live:
            return tuple(
                ThreadObservation(t.tid, t.name, matcher.role(t.name), t.cpus, pid=pid)
                for t in self.scan()
            )
        steady = self._steady_observe(matcher)
        if steady is not None:
            return steady
        out: list[ThreadObservation] = []
        entries = self._scan_entries()
        for entry in entries:
            observed = entry.observed
            if observed is not None and entry.matcher is matcher:
                out.append(observed)
                continue
            live = entry.live
            if live is None:
                continue
            observed = ThreadObservation(
                live.tid, live.name, matcher.role(live.name), live.cpus, live.id, pid
            )
            entry.observed = observed
            entry.matcher = matcher
            out.append(observed)
        result = tuple(out)
        self._remember(matcher, entries, result)
        return result

    def _steady_observe(self, matcher: RoleMatcher) -> tuple[ThreadObservation, ...] | None:
        """Last scan's observations when nothing changed since (see the class); None
        when anything may have: the full scan then finds out what."""
        steady = self._steady
        n = self._scan
        if steady is None or steady.matcher is not matcher or n % self.rename_every == 0:
            return None
        getaffinity = os.sched_getaffinity
        try:
            if os.stat(self.fs.path(f"proc/{self.pid}/task")).st_nlink != self._nlink:
                return None
            # The periodic listing: the same tids is all it is for (a full scan cost 3x).
            if n % self.relist_every == 0 and list_tids(self.fs, self.pid) != steady.tids:
                return None
            if [getaffinity(tid) for tid in steady.tids] != steady.cpus:
                return None
        except OSError:
            return None  # a thread (or the process) is gone: the full scan says which
        self._scan = n + 1
        return steady.observed

    def _remember(
        self, matcher: RoleMatcher, entries: list[_Known], observed: tuple[ThreadObservation, ...]
    ) -> None:
        """Keep this scan for `_steady_observe` when every thread is settled in it."""
        young = self.young_scans
        if len(entries) != len(self._known) or any(
            e.live is None or e.cpus is None or e.scans < young for e in entries
        ):
            self._steady = None
            return
        self._steady = _Steady(
            matcher,
            observed,
            [e.live.tid for e in entries if e.live is not None],
            [e.cpus for e in entries if e.cpus is not None],
        )

    def _scan_entries(self) -> list[_Known]:
        task_path = self.fs.path(f"proc/{self.pid}/task")
        try:
            nlink = os.stat(task_path).st_nlink
        except OSError:
            self._known.clear()
            self._nlink = -1
            return []
        relist = self._scan % self.relist_every == 0
        rename = self._scan % self.rename_every == 0
        self._scan += 1
        if relist or nlink != self._nlink:
            self._relist(nlink)
        out, vanished = self._read(self._known, rename)
        if vanished:
            # A thread exited since the last listing, and another may have
            # started with the count unchanged: list again now, read newcomers.
            for tid in vanished:
                del self._known[tid]
            try:
                nlink = os.stat(task_path).st_nlink
            except OSError:
                nlink = -1
            self._relist(nlink)
            fresh = {tid: e for tid, e in self._known.items() if e.live is None}
            more, gone = self._read(fresh, rename)
            for tid in gone:
                del self._known[tid]
                self._nlink = -1
            out.extend(more)
            out.sort(key=lambda e: e.live.tid if e.live is not None else -1)
        return out

    def _read(self, known: dict[int, _Known], rename: bool) -> tuple[list[_Known], list[int]]:
        """Update each `known` thread's affinity (and name, when due); and the vanished tids."""
        out: list[_Known] = []
        vanished: list[int] = []
        young = self.young_scans
        getaffinity = os.sched_getaffinity
        for tid, entry in known.items():
            try:
                cpus = getaffinity(tid)
            except OSError as err:
                if err.errno in _GONE:
                    vanished.append(tid)
                    continue
                raise translate_oserror(f"tid {tid}", err) from None
            live = entry.live
            if live is not None and cpus == entry.cpus and not rename and entry.scans >= young:
                out.append(entry)  # the steady state: nothing to read or build
                continue
            if live is None or cpus != entry.cpus:
                # sched_getaffinity answers for any tid on the host: a thread
                # of ours that exited may have handed its tid to another
                # process (or to a new thread of ours). Its start time, read
                # under /proc/<pid>/task (ours only), tells (issue 11).
                start = read_thread_start(self.fs, self.pid, tid)
                known_start = None if entry.id is None else entry.id.start_time
                if start is None or (live is not None and start != known_start):
                    vanished.append(tid)
                    continue
                if start != known_start:
                    entry.id = ThreadId(tid, start)
            if live is None or rename or entry.scans < young:
                name = _read_comm(self.fs, self.pid, tid)
                if name is None:
                    vanished.append(tid)
                    continue
            else:
                name = live.name
            entry.scans += 1
            if live is None or cpus != entry.cpus or name != live.name:
                entry.live = LiveThread(tid, name, tuple(sorted(cpus)), entry.id)
                entry.cpus = cpus
                entry.observed = None
            out.append(entry)
        return out, vanished

    def _relist(self, nlink: int) -> None:
        tids = list_tids(self.fs, self.pid)
        known = self._known
        self._known = {tid: known.get(tid) or _Known() for tid in tids}
        self._nlink = nlink


# -- memory ------------------------------------------------------------------


def local_memory_ratio(
    bytes_by_node: Mapping[int, int], planned_mems: Sequence[int]
) -> float | None:
    """Share of resident bytes on `planned_mems` (0..1); None when nothing is resident."""
    total = sum(bytes_by_node.values())
    if total <= 0:
        return None
    local = sum(bytes_by_node.get(node, 0) for node in set(planned_mems))
    return local / total


# -- IRQs, allowed and online CPUs -------------------------------------------------


def read_irq_delivery(fs: HostFS, irq: int) -> tuple[int, ...] | None:
    """The CPUs IRQ `irq` is delivered to, as far as the kernel knows; None when gone.

    effective_affinity_list when it lies inside smp_affinity_list. On x86
    without interrupt remapping a new affinity takes effect at the IRQ's next
    interrupt (the vector moves in the interrupt path,
    kernel/irq/migration.c), so right after a write, and forever for an IRQ
    that never fires, the effective CPU still names the old target. The
    affinity itself is then what the next interrupt will use, and is reported.
    """
    affinity_text = fs.read_optional(f"proc/irq/{irq}/smp_affinity_list")
    effective_text = fs.read_optional(f"proc/irq/{irq}/effective_affinity_list")
    affinity = _parse_optional(affinity_text)
    effective = _parse_optional(effective_text)
    if affinity is None:
        return None if effective is None else tuple(sorted(effective))
    if effective and effective <= affinity:
        return tuple(sorted(effective))
    return tuple(sorted(affinity))


def _parse_optional(text: str | None) -> frozenset[int] | None:
    if text is None or not text.strip():
        return None
    try:
        return parse_cpulist(text)
    except ValueError:
        return None


def read_self_allowed(
    fs: HostFS, cache: CpusetCache | None = None, scope: EngineScope | None = None
) -> tuple[frozenset[int], frozenset[int]]:
    """The CPUs and memory nodes the supervisor may plan on now.

    proc/self/status Cpus_allowed_list / Mems_allowed_list narrowed by the
    effective cpuset of its own cgroup (v1 or v2), read with the discovery
    helpers of supervisor.topology.cgroup; in attach mode (`scope` with the
    engine's cgroup) that cgroup's effective cpuset instead, as discovery reads
    it (topology.cgroup.read_allowed); either narrowed by `engine.attach.cpus`.
    Not intersected with the online CPUs (see `read_online_cpus`); may be empty.
    The daemon compares successive values (supervisor.watch.loop) to detect a
    cpuset change. With `cache`, the cpuset's files are found again only when
    the cgroup or the mounts changed (topology.cgroup.read_cpuset_cached).
    """
    lines = None if scope is None else scope.lines
    if lines is not None:
        cpuset = cpuset_of(fs, lines) if cache is None else read_cpuset_cached(fs, cache, lines)
        if cpuset is None or cpuset.cpus is None:
            raise TopologyError("the engine's cgroup has no readable cpuset", PROC_CGROUP)
        cpus = cpuset.cpus
        if cpuset.mems is not None:
            mems = cpuset.mems
        else:
            mems = parse_status_allowed(fs.read_required(STATUS, "allowed memory nodes"))[1]
    else:
        status = fs.read_required(STATUS, "the supervisor's allowed CPUs")
        cpus, mems = parse_status_allowed(status)
        cpuset = read_cpuset(fs) if cache is None else read_cpuset_cached(fs, cache)
        if cpuset is not None and cpuset.cpus is not None:
            cpus &= cpuset.cpus
        if cpuset is not None and cpuset.mems is not None:
            mems &= cpuset.mems
    if scope is not None and scope.cpus is not None:
        cpus &= scope.cpus
    return cpus, mems


def read_online_cpus(fs: HostFS) -> frozenset[int]:
    """The CPUs online now (sys/devices/system/cpu/online), for hotplug checks."""
    text = fs.read_required("sys/devices/system/cpu/online", "the online CPUs")
    return parse_cpulist(text)


# -- one process -------------------------------------------------------------


def observe_process(
    fs: HostFS,
    pid: int,
    slot: Slot,
    process: ProcessKind,
    *,
    roles: Sequence[ThreadRole] = (),
    numa_stat: Mapping[int, int] | None = None,
    numa_maps: bool = False,
    scanner: ThreadScanner | None = None,
    matcher: RoleMatcher | None = None,
    irqs: Mapping[int, Sequence[int]] | None = None,
    previous: Observation | None = None,
    now: float | None = None,
) -> Observation:
    """The live state of one supervised process, as a `state.Observation`.

    Threads come from `scanner` when given (keep one per process across
    checks), else `read_threads`; roles from `matcher` (or `roles`).
    Memory by node: the process's numa_maps when `numa_maps` (exact but
    it walks page tables), else `numa_stat` (its own cgroup's
    memory.numa_stat, cheap), else the `previous` observation's memory.
    `irqs` maps each planned IRQ to its planned CPUs. Raises `errors.Gone`
    when the process no longer exists.
    """
    match = matcher if matcher is not None else RoleMatcher(process, roles)
    if scanner is not None:
        observed = scanner.observe(match)
    else:
        observed = tuple(
            ThreadObservation(t.tid, t.name, match.role(t.name), t.cpus)
            for t in read_threads(fs, pid)
        )
    if not observed and not fs.exists(f"proc/{pid}"):
        raise Gone(f"pid {pid}", OSError(errno.ESRCH, os.strerror(errno.ESRCH)))
    memory: Mapping[int, int]
    ratio: float | None
    # No memory node (attach mode: the rank's node is outside the engine's cpuset.mems,
    # plan.planner): its pages are left where they are, so no ratio, nothing to move.
    if numa_maps:
        memory = read_numa_maps(fs, pid)
        ratio = local_memory_ratio(memory, slot.mems) if slot.mems else None
    elif numa_stat is not None:
        memory = dict(numa_stat)
        ratio = local_memory_ratio(memory, slot.mems) if slot.mems else None
    elif previous is not None:
        memory, ratio = previous.memory_bytes_by_node, previous.local_memory_ratio
    else:
        memory, ratio = {}, None
    irq_obs = tuple(
        IrqObservation(irq, read_irq_delivery(fs, irq) or (), tuple(sorted(planned)))
        for irq, planned in sorted((irqs or {}).items())
    )
    return Observation(
        threads=observed,
        memory_bytes_by_node=MappingProxyType(dict(sorted(memory.items()))),
        local_memory_ratio=ratio,
        irqs=irq_obs,
        observed_at=time.time() if now is None else now,
    )
