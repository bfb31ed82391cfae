"""The Binder: the one object that changes live processes (does I/O: syscalls, /proc reads).

Thread affinity, whole-process affinity and page migration of processes other
than the caller. The shim binds a worker from birth; the drift loop and the
API's rebind call this object afterwards. Every failure is a `KernelError`
subclass whose `target` names the tid or pid ("tid 4242").
"""

from __future__ import annotations

import array
import errno
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from supervisor.bind import syscalls
from supervisor.errors import Gone, KernelError, translate_oserror
from supervisor.hostfs import HostFS
from supervisor.procfs.numa_maps import parse_own_ranges

CAP_SYS_NICE = 23  # include/uapi/linux/capability.h


# move_pages(2) addresses per call: 64 MiB of base pages.
PAGES_PER_CALL = 16384
# move_pages(2) statuses of an address with no page to move: not present, not mapped.
NOT_THERE = (-errno.ENOENT, -errno.EFAULT)


@dataclass(frozen=True, slots=True)
class ProcessBind:
    """What `set_process_affinity` did: per thread, the affinity read back or the error.

    Threads that exited between listing and binding are in `gone`, not `failed`:
    a thread's death is not a bind failure.
    """

    pid: int
    bound: Mapping[int, frozenset[int]] = field(default_factory=dict)
    failed: Mapping[int, KernelError] = field(default_factory=dict)
    gone: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failed


def parse_cap_eff(status_text: str) -> int:
    """The CapEff bit set of a /proc/<pid>/status text (0 when absent)."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split(":", 1)[1].strip(), 16)
    return 0


class Binder:
    """Sets and reads CPU affinity per thread, migrates pages; reads /proc through `fs`.

    `fs` must be the live host (root "/") for pids and tids to mean anything;
    it is only used to list /proc/<pid>/task and read /proc/self/status.
    """

    __slots__ = ("fs",)

    def __init__(self, fs: HostFS | None = None) -> None:
        self.fs = fs if fs is not None else HostFS("/")

    def __repr__(self) -> str:
        return f"Binder({self.fs!r})"

    # -- CPU affinity -------------------------------------------------------

    def set_thread_affinity(self, tid: int, cpus: Iterable[int]) -> frozenset[int]:
        """Pin one thread (sched_setaffinity(2) takes a tid on Linux); returns what
        the kernel kept, read back (it may trim CPUs that went offline).

        Raises Gone (ESRCH), Invalid (EINVAL: no CPU of `cpus` in the thread's
        cpuset), Denied (EPERM: another user's thread without CAP_SYS_NICE).
        """
        wanted = frozenset(cpus)
        target = f"tid {tid}"
        try:
            os.sched_setaffinity(tid, wanted)
            return frozenset(os.sched_getaffinity(tid))
        except OSError as err:
            raise translate_oserror(target, err) from None

    def get_thread_affinity(self, tid: int) -> frozenset[int]:
        """The CPUs a thread may run on; raises Gone when it has exited."""
        try:
            return frozenset(os.sched_getaffinity(tid))
        except OSError as err:
            raise translate_oserror(f"tid {tid}", err) from None

    def thread_ids(self, pid: int) -> list[int]:
        """The tids of process `pid`, sorted; raises Gone when the process has exited."""
        rel = f"proc/{pid}/task"
        try:
            names = os.listdir(self.fs.path(rel))
        except OSError as err:
            raise translate_oserror(f"pid {pid}", err) from None
        return sorted(int(name) for name in names if name.isdigit())

    def set_process_affinity(self, pid: int, cpus: Iterable[int]) -> ProcessBind:
        """Pin every thread of `pid` to `cpus`, one sched_setaffinity per tid.

        A process's affinity is per thread: setting it on the pid alone only
        moves the main thread, and threads already started keep theirs.
        Threads that exit meanwhile are skipped; other failures are collected
        per thread, never raised. Raises Gone when the process itself is gone.
        """
        wanted = frozenset(cpus)
        bound: dict[int, frozenset[int]] = {}
        failed: dict[int, KernelError] = {}
        gone: list[int] = []
        for tid in self.thread_ids(pid):
            try:
                bound[tid] = self.set_thread_affinity(tid, wanted)
            except Gone:
                gone.append(tid)
            except KernelError as err:
                failed[tid] = err
        if gone and not bound and not failed:
            # Every thread vanished: the process exited while we listed it.
            raise translate_oserror(f"pid {pid}", OSError(errno.ESRCH, os.strerror(errno.ESRCH)))
        return ProcessBind(pid, bound, failed, tuple(gone))

    # -- memory -------------------------------------------------------------

    def migrate_pages(self, pid: int, from_nodes: Iterable[int], to_nodes: Iterable[int]) -> int:
        """Move `pid`'s pages from `from_nodes` to `to_nodes` (migrate_pages(2)).

        Returns the number of pages not moved (busy, pinned, or shared without
        CAP_SYS_NICE). Synchronous: the kernel copies the pages in this call,
        so callers rate-limit it (drift.migrate_max_bytes_per_s) and run it in
        the executor. Raises Gone, Denied, Invalid with target "pid N".
        """
        return syscalls.migrate_pages(pid, from_nodes, to_nodes)

    def move_own_pages(
        self, pid: int, from_nodes: Iterable[int], to_node: int, max_bytes: int
    ) -> tuple[int, int]:
        """Move up to `max_bytes` of the memory `pid` allocated (anonymous, its
        shared memory and huge pages: what its local ratio counts) from
        `from_nodes` to `to_node`; (bytes moved, remote pages seen and not
        moved: refused, or past the budget, where the walk stops and the next
        pass goes on). Mapped files and any page another process maps too
        stay where they are: move_pages(2) with MPOL_MF_MOVE.

        Chunked: PAGES_PER_CALL addresses a call, so one call holds the
        worker's mmap lock for 64 MiB at most, and a move of gigabytes spreads
        over passes (`max_bytes` is one pass's share of
        drift.migrate_max_bytes_per_s, counted from numa_maps' pages per
        node). Raises Gone, Denied (seccomp, no CAP_SYS_NICE), Invalid with
        target "pid N".
        """
        remote = frozenset(from_nodes)
        try:
            maps = self.fs.read_text(f"proc/{pid}/maps")
            numa = self.fs.read_text(f"proc/{pid}/numa_maps")
        except OSError as err:
            raise translate_oserror(f"pid {pid}", err) from None
        budget = max(max_bytes, 1)
        moved = left = 0
        for start, end, page, remote_pages in parse_own_ranges(maps, numa, remote):
            if budget <= 0:
                left += remote_pages  # the next pass's share
                continue
            step = PAGES_PER_CALL * page
            chunks = (
                array.array("Q", range(a, min(end, a + step), page))
                for a in range(start, end, step)
            )
            if remote_pages * page <= budget:
                # All of it fits: one call a chunk, every address (a page already
                # on `to_node` is left as it is by the kernel), no query first.
                failed = 0
                for addresses in chunks:
                    status = syscalls.move_pages(pid, addresses, to_node)
                    failed += sum(1 for s in status if s < 0 and s not in NOT_THERE)
                moved += max(remote_pages - failed, 0) * page
                left += min(failed, remote_pages)
                budget -= remote_pages * page
                continue
            # More than the budget: ask where each page of a chunk is, move the
            # remote ones until the budget is spent; the next pass goes on.
            here = 0
            for addresses in chunks:
                where = syscalls.move_pages(pid, addresses)
                todo = array.array(
                    "Q", (a for a, n in zip(addresses, where, strict=True) if n in remote)
                )
                todo = todo[: max(budget // page, 1)]
                if todo:
                    status = syscalls.move_pages(pid, todo, to_node)
                    here += sum(1 for s in status if s == to_node)
                    budget -= len(todo) * page
                if budget <= 0:
                    break
            moved += here * page
            left += max(remote_pages - here, 0)
        return moved, left

    def can_migrate_other(self) -> bool:
        """True when this process holds CAP_SYS_NICE (CapEff bit 23).

        migrate_pages(2) of another process needs it unless the uids match,
        and moving pages that other processes also map always needs it.
        """
        text = self.fs.read_optional("proc/self/status")
        if text is None:
            return False
        return bool(parse_cap_eff(text) >> CAP_SYS_NICE & 1)
