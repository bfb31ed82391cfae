"""Carry out the check loop's decisions through bind/ (blocking: run in the executor).

`Applier.apply(decisions)` makes every cgroup join (an adoption's), thread
bind, memory migration and IRQ re-write of a pass or of an adoption, each
failure isolated to its process, thread or IRQ set,
and returns one `settle.Outcomes` per decision. It touches a tid only while
it is still the thread the scan saw: before and after each write it checks
the tid's Tgid and start time (a tid handed to an unrelated process is never
written; issue 11): the Tgid is the tree member the thread runs in where the
bind names one, else the decision's process. A pid is checked by its start
time before it joins a cgroup or its pages move.
`update_cgroups` sets the instance dir and the moved processes' cgroups to a
new plan; `repair_cgroup` puts back a process's own cgroup that someone else
removed or rewrote. Nothing here writes the StateStore.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from supervisor.bind.binder import Binder
from supervisor.bind.cgroup import CgroupManager, ProcessCgroup
from supervisor.cpulist import format_cpulist
from supervisor.errors import Gone, KernelError, translate_oserror
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Placement, Slot
from supervisor.plan.replan import AllowedSet
from supervisor.procfs.identity import ProcessId, is_leader_since, is_thread_of
from supervisor.watch.decide import Decision, MemoryMove, ThreadBind
from supervisor.watch.scan import IrqKeeperLike
from supervisor.watch.settle import Outcome, Outcomes

log = logging.getLogger("placement_supervisor.checker")


class CgroupsLike(Protocol):
    """The parts of `service.cgroups.ManagedCgroups` the loop reads (numa_stat) and updates."""

    manager: CgroupManager
    made: dict[ProcKey, ProcessCgroup]

    def create(self, key: ProcKey, slot: Slot) -> tuple[str, ...]: ...

    def repair(self, key: ProcKey, slot: Slot, pids: Sequence[int]) -> None: ...


class Applier:
    """The loop's hands: the binder, the IRQ keeper and the cgroups."""

    def __init__(
        self,
        fs: HostFS,
        binder: Binder,
        irqs: IrqKeeperLike | None,
        cgroups: CgroupsLike | None,
    ) -> None:
        self.fs = fs
        self.binder = binder
        self.irqs = irqs
        self.cgroups = cgroups

    # -- one pass ------------------------------------------------------------------

    def apply(
        self,
        decisions: Sequence[Decision],
        ids: Mapping[ProcKey, ProcessId | None],
        placement: Placement | None = None,
    ) -> list[Outcomes]:
        """Every bind of a pass. `ids`: who each process is (pid reuse; None or
        absent: unknown, whatever runs at the decision's pid is it);
        `placement`: the plan in force, whose IRQs a decision's re-write puts back."""
        out: list[Outcomes] = []
        for d in decisions:
            ident = ids.get(d.key)
            start = None if ident is None else ident.start_time
            if (d.binds or d.moves or d.joins or d.cgroup) and not is_leader_since(
                self.fs, d.pid, start
            ):
                # The pid names another process now (reaped and reused): nothing of
                # it is ours. Its runner reports the exit.
                gone = Outcome(gone=True)
                out.append(Outcomes(dict.fromkeys((b.tid for b in d.binds), gone), gone=True))
                continue
            # The cgroups first: their cpuset then bounds whatever the process does
            # next (and a thread bind outside a wrong cpuset would fail).
            cgroup = self.repair_cgroup(d) if d.cgroup is not None else None
            joins = tuple(self.join(d.key, ident) for ident in d.joins)
            threads = {
                b.tid: self.bind_thread(d.pid if b.pid is None else b.pid, b) for b in d.binds
            }
            moves = tuple(self.migrate(d.pid, start, m) for m in d.moves)
            irq = (
                self.enforce_irqs(d.key, placement)
                if d.irq_reason is not None and placement is not None
                else None
            )
            out.append(Outcomes(threads, moves, irq, joins, cgroup=cgroup))
        return out

    def join(self, key: ProcKey, ident: ProcessId) -> Outcome:
        """Move process `ident` into the cgroups of `key`, only while its pid is it."""
        cgroups = self.cgroups
        pc = cgroups.made.get(key) if cgroups is not None else None
        if cgroups is None or pc is None:
            return Outcome()
        if not ident.leads(self.fs):
            return Outcome(gone=True)
        try:
            cgroups.manager.join(pc, ident.pid)
        except Gone:
            return Outcome(gone=True)
        except KernelError as err:
            return Outcome(error=err)
        return Outcome()

    def repair_cgroup(self, d: Decision) -> Outcome:
        """Re-make/repair the process's own cgroup and put its processes back in."""
        if self.cgroups is None or d.cgroup is None:
            return Outcome(gone=True)
        r = d.cgroup
        try:
            self.cgroups.repair(d.key, Slot(r.cpus, r.mems), r.pids)
        except KernelError as err:
            return Outcome(error=err)
        log.info(
            "cgroup repaired %s",
            format_fields(
                rank=key_label(d.key),
                cpus=format_cpulist(r.cpus),
                mems=format_cpulist(r.mems),
                pids=",".join(map(str, r.pids)),
                reason=r.reason,
            ),
        )
        return Outcome()

    def bind_thread(self, pid: int, b: ThreadBind) -> Outcome:
        """sched_setaffinity(2) on `b.tid`, only while it is the thread of `pid` the
        scan saw; a tid that is no longer that thread counts as gone."""
        if not self._is_thread(pid, b):
            return Outcome(gone=True)
        try:
            kept = self.binder.set_thread_affinity(b.tid, b.cpus)
        except Gone:
            return Outcome(gone=True)
        except KernelError as err:
            return Outcome(error=err)
        if not self._is_thread(pid, b):
            # Reused between the check and the write (a window of microseconds):
            # say so; the tid is never written again, the scan drops it.
            log.warning(
                "tid reused %s",
                format_fields(pid=pid, tid=b.tid, cpus=format_cpulist(b.cpus), action="drop"),
            )
            return Outcome(gone=True)
        if kept != frozenset(b.cpus):
            # sched_setaffinity(2) keeps only the CPUs the cpuset allows: a
            # partial bind is a failure, or the next pass would redo it forever.
            partial = translate_oserror(
                f"tid {b.tid}",
                OSError(
                    errno.EINVAL,
                    f"kernel kept CPUs {format_cpulist(kept)} of {format_cpulist(b.cpus)}"
                    " (outside the cgroup cpuset?)",
                ),
            )
            return Outcome(error=partial, kept=tuple(sorted(kept)))
        return Outcome(kept=tuple(sorted(kept)))

    def _is_thread(self, pid: int, b: ThreadBind) -> bool:
        """`b.tid` is still the thread of `pid` the scan saw (by its Tgid alone
        where the scan had no start time for it)."""
        if b.id is None:
            return is_thread_of(self.fs, pid, b.tid, None)
        return b.id.is_thread_of(self.fs, pid)

    def migrate(self, pid: int, start_time: int | None, m: MemoryMove) -> Outcome:
        if not is_leader_since(self.fs, pid, start_time):
            return Outcome(gone=True)  # the pid names another process now
        try:
            if m.max_bytes > 0:
                # The mems of a rank are one node in every plan; the first otherwise.
                moved, left = self.binder.move_own_pages(
                    pid, m.from_nodes, m.to_nodes[0], m.max_bytes
                )
                return Outcome(pages_left=left, bytes_moved=moved)
            return Outcome(pages_left=self.binder.migrate_pages(pid, m.from_nodes, m.to_nodes))
        except Gone:
            return Outcome(gone=True)
        except KernelError as err:
            return Outcome(error=err)

    def enforce_irqs(self, key: ProcKey, placement: Placement) -> Outcome:
        if self.irqs is None:
            return Outcome()
        try:
            outcomes = self.irqs.enforce(key, placement)
        except KernelError as err:
            return Outcome(error=err)
        except Exception as err:  # the keeper's bug stays the keeper's
            return Outcome(
                error=KernelError(f"irqs of {key_label(key)}", OSError(errno.EIO, str(err)))
            )
        bound = tuple((o.irq, o.cpus) for o in outcomes if o.status == "bound")
        return Outcome(irqs_bound=bound)

    # -- a new plan ------------------------------------------------------------------

    def update_cgroups(
        self, allowed: AllowedSet, slots: Mapping[ProcKey, Slot], moved: Iterable[ProcKey]
    ) -> list[tuple[ProcKey | None, KernelError]]:
        """Each moved process's cgroup to the new plan (a no-op on v1, which has no
        per-process cpusets: supervisor.bind.cgroup). `allowed` is the new allowed set."""
        cgroups = self.cgroups
        if cgroups is None:
            return []
        failed: list[tuple[ProcKey | None, KernelError]] = []
        for key in moved:
            if key not in cgroups.made:
                continue
            try:
                cgroups.create(key, slots[key])
            except KernelError as err:
                failed.append((key, err))
        return failed
