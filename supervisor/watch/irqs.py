"""The IRQ keeper: keeps every rank's planned IRQs on its `irq` CPUs (does I/O:
/proc/irq through IrqBinder, irqbalance's control socket).

`IrqKeeper` writes the IRQ plan of the placement it is handed at each call
(`RankPlacement.irqs`, made by the planner through supervisor.plan.irqs: the
plan in force, supervisor.in_force; it plans nothing and holds no plan),
reads it back with the one reader (`observe.read_irq_delivery`), reports drift
by the one rule (`drift.irq_drifted`), re-writes on request and puts the
originals back when the daemon stops. Its methods block (file writes, a unix
socket): the daemon calls them from its executor. It never writes the
StateStore: what is worth an event or a counter is kept as an `IrqFact` that
the caller takes (`take_facts`) on the event loop and records
(supervisor.events.Recorder.facts). Over 500 lines because apply, observe,
enforce, re-plan, restore and the irqbalance ban share one lock and one
status table; splitting them would spread that state across modules.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from supervisor.bind.irq import (
    IrqbalanceInfo,
    IrqBinder,
    ban_irqs,
    detect_irqbalance,
    read_banned_irqs,
)
from supervisor.bind.irq_checkpoint import IrqCheckpoint
from supervisor.config import IrqConfig
from supervisor.cpulist import format_cpulist
from supervisor.errors import Denied, KernelError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import IrqAssignment, Placement
from supervisor.state import EventKind, IrqObservation
from supervisor.watch.drift import irq_drifted
from supervisor.watch.observe import read_irq_delivery

log = logging.getLogger("placement_supervisor.irqs")

IrqStatus = Literal["planned", "bound", "managed", "gone", "failed", "off"]


@dataclass(frozen=True, slots=True)
class IrqFact:
    """Something the keeper did or saw that is worth an event (and a log line).

    `failure`: a refused bind, as (reason, errno name): counted in
    bind_failures{target="irq"}. `log_message`: the STYLE log line's text, its
    key=values `fields` or `log_fields` where they read differently (cpulists).
    """

    kind: EventKind
    key: ProcKey | None
    message: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    log_message: str | None = None
    level: int = logging.INFO
    log_fields: Mapping[str, Any] | None = None
    failure: str | None = None  # the bind failure reason, when this is one


def _irq_plan(placement: Placement) -> Mapping[ProcKey, tuple[IrqAssignment, ...]]:
    """The placement's IRQ plan by rank (every rank, possibly with none)."""
    return MappingProxyType({r.rank: r.irqs for r in placement.ranks})


# -- the keeper -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IrqOutcome:
    """What one write (or refusal) did to one IRQ."""

    key: ProcKey
    irq: int
    status: IrqStatus
    cpus: tuple[int, ...] = ()  # what the kernel reports after the write
    error: str | None = None


class IrqKeeper:
    """Keeps every rank's planned IRQs on its `irq` CPUs for the daemon's lifetime.

    The IRQs are those of the placement each call is given (`RankPlacement.irqs`
    of the plan in force); `config` says only whether to write them
    (`enabled`) and how to treat irqbalance. Blocking: every public method
    reads or writes /proc/irq (and may talk to irqbalance's socket), so the
    daemon calls them through `loop.run_in_executor`. Calls are serialised by
    a lock. Events and counts are facts for the caller (`take_facts`);
    `enforce` returns its outcomes, which the check loop counts in
    rebinds{reason="irq_affinity"}.

    Failures never stop a worker: a kernel-managed IRQ is skipped and
    reported once (bind_failures{target="irq",reason="managed"}); a read-only
    /proc/irq (Denied) turns IRQ binding off for the run with one warning.
    """

    def __init__(
        self, fs: HostFS, config: IrqConfig, *, checkpoint: IrqCheckpoint | None = None
    ) -> None:
        self.fs = fs
        self.config = config
        # With a checkpoint, every original is in its file before our first write.
        self.binder = IrqBinder(fs, checkpoint)
        self._lock = threading.Lock()
        self._facts: list[IrqFact] = []
        self._status: dict[int, IrqStatus] = {}
        self._reported: set[tuple[int, str]] = set()  # (irq, reason) failures already counted
        self._moved: dict[int, tuple[int, ...]] = {}  # IRQs seen off their CPUs, and where
        self._off_reason: str | None = None
        self._irqbalance: IrqbalanceInfo | None = None
        self._banned_before: frozenset[int] | None = None  # irqbalance's list before our ban
        self._banned: frozenset[int] = frozenset()

    def take_facts(self) -> list[IrqFact]:
        """The facts since the last call, oldest first (call on the event loop)."""
        with self._lock:
            facts, self._facts = self._facts, []
        return facts

    def _fact(
        self,
        kind: EventKind,
        key: ProcKey | None,
        message: str,
        *,
        log_message: str | None = None,
        level: int = logging.INFO,
        log_fields: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        """A fact for the loop's recorder (which logs it then: never log it here too)."""
        shown = None if log_fields is None else MappingProxyType(dict(log_fields))
        self._facts.append(
            IrqFact(kind, key, message, MappingProxyType(fields), log_message, level, shown)
        )

    def __repr__(self) -> str:
        bound = sum(1 for s in self._status.values() if s == "bound")
        return f"IrqKeeper({self.fs!r}, bound={bound}, off={self._off_reason!r})"

    # -- queries (no I/O) ------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """False when the config turns IRQ binding off or /proc/irq refused us."""
        return self.config.enabled and self._off_reason is None

    @property
    def irqbalance(self) -> IrqbalanceInfo | None:
        """The irqbalance found at the last apply/enforce, if any."""
        return self._irqbalance

    @property
    def banned(self) -> frozenset[int]:
        """The IRQs irqbalance was asked to leave alone."""
        return self._banned

    def planned_irqs(
        self, placement: Placement, key: ProcKey | None = None
    ) -> dict[int, tuple[int, ...]]:
        """IRQ -> planned CPUs of the IRQs we keep (bound ones), of one rank or all."""
        out: dict[int, tuple[int, ...]] = {}
        for k, assignments in _irq_plan(placement).items():
            if key is not None and k != key:
                continue
            for a in assignments:
                if self._status.get(a.irq) == "bound":
                    out[a.irq] = a.cpus
        return out

    # -- apply ------------------------------------------------------------------

    def apply(self, placement: Placement) -> tuple[IrqOutcome, ...]:
        """Write every IRQ `placement` plans; then ask irqbalance to keep off them.

        IRQs written before that `placement` no longer plans (a new plan put in
        force) get their original affinity back first. Blocking; call from the
        executor. Returns one outcome per IRQ tried.
        """
        if not self.config.enabled:
            return ()
        plan = _irq_plan(placement)
        with self._lock:
            keep = {a.irq for assignments in plan.values() for a in assignments}
            for irq in sorted(self.binder.touched):
                if irq not in keep:
                    self._restore_one(irq)
            self._status = {irq: s for irq, s in self._status.items() if irq in keep}
            if self._off_reason is not None:
                return ()
            outcomes = self._apply_locked(plan)
            self._coordinate_irqbalance(placement)
        return outcomes

    def _apply_locked(
        self, plan: Mapping[ProcKey, tuple[IrqAssignment, ...]]
    ) -> tuple[IrqOutcome, ...]:
        outcomes: list[IrqOutcome] = []
        if self._off_reason is None:  # every original saved in one write, before any bind
            self.binder.save_originals(a.irq for assignments in plan.values() for a in assignments)
        for key, assignments in plan.items():
            if self._off_reason is not None:
                break
            done = [self._bind_one(key, a) for a in assignments if self._off_reason is None]
            outcomes.extend(done)
            bound = [o for o in done if o.status == "bound"]
            if not assignments:
                continue
            label = key_label(key)
            cpus = format_cpulist(assignments[0].cpus)
            irqs = format_cpulist(o.irq for o in bound)
            shown = {
                "irqs": irqs or None,
                "cpus": cpus,
                "owners": ",".join(sorted({a.owner for a in assignments})),
                "skipped": len(done) - len(bound),
            }
            if bound:
                self._fact(
                    "irq",
                    key,
                    f"{label}: IRQs {irqs} on CPUs {cpus}",
                    log_message="irq bound",
                    log_fields=shown,
                    irqs=[o.irq for o in bound],
                    cpus=list(assignments[0].cpus),
                    owners=sorted({a.owner for a in assignments}),
                )
            else:  # nothing bound: no event, the line says why not (skipped)
                log.info("irq bound %s", format_fields(rank=label, **shown))
        return tuple(outcomes)

    def _bind_one(self, key: ProcKey, a: IrqAssignment) -> IrqOutcome:
        """One write; Denied turns binding off, other refusals skip the IRQ."""
        try:
            effective = self.binder.bind(a.irq, a.cpus)
        except Denied as err:
            self._turn_off(key, a, err)
            return IrqOutcome(key, a.irq, "off", error=str(err))
        except KernelError as err:
            status: IrqStatus = (
                "managed"
                if err.reason == "managed"
                else "gone"
                if err.reason == "gone"
                else "failed"
            )
            # A managed or vanished IRQ is final; any other refusal stays
            # planned, so observe keeps reporting it and the next enforce
            # retries it (the failure is counted once, in _failed).
            self._status[a.irq] = status if status != "failed" else "bound"
            self._failed(key, a, err)
            return IrqOutcome(key, a.irq, status, error=str(err))
        self._status[a.irq] = "bound"
        self._moved.pop(a.irq, None)
        return IrqOutcome(key, a.irq, "bound", tuple(sorted(effective)))

    def _failed(self, key: ProcKey, a: IrqAssignment, err: KernelError) -> None:
        """Count and report a refused IRQ once per (IRQ, reason); later refusals are quiet."""
        if (a.irq, err.reason) in self._reported:
            return
        self._reported.add((a.irq, err.reason))
        label = key_label(key)
        # A managed IRQ is the kernel spreading a multi-queue device's vectors
        # itself (Documentation/core-api/irq/managed_irq.rst): expected, skipped.
        why = "kernel-managed" if err.reason == "managed" else err.errno_name
        self._bind_failed(
            key, a, err, f"{label}: irq {a.irq} ({a.owner}) not bound: {why}", "skip", owner=a.owner
        )

    def _turn_off(self, key: ProcKey, a: IrqAssignment, err: KernelError) -> None:
        # A container's /proc is usually mounted read-only (Docker, Kubernetes
        # without privileged mode): every write would fail the same way, so say
        # it once and stop trying for this run.
        self._off_reason = str(err)
        label = key_label(key)
        why = (
            "its original could not be kept in the IRQ checkpoint: nothing is moved"
            if "checkpoint" in err.target
            else "/proc/irq is read-only or we lack privilege"
        )
        self._bind_failed(
            key,
            a,
            err,
            f"{label}: IRQ binding off for this run: {err.target}: {err.errno_name} ({why})",
            "disable irq binding",
        )

    def _bind_failed(
        self,
        key: ProcKey,
        a: IrqAssignment,
        err: KernelError,
        message: str,
        action: str,
        **fields: object,
    ) -> None:
        """A refused IRQ bind: counted in bind_failures{target="irq"} when recorded."""
        self._facts.append(
            IrqFact(
                "bind_failed",
                key,
                message,
                MappingProxyType(
                    {"irq": a.irq, **fields, "errno": err.errno_name, "action": action}
                ),
                failure=err.reason,
            )
        )

    # -- irqbalance ---------------------------------------------------------------

    def _coordinate_irqbalance(self, placement: Placement) -> None:
        """Detect irqbalance; in "ban" mode ask it to leave our bound IRQs alone.

        It is never stopped: it keeps balancing everything else. When its
        socket does not answer (built without it, another mount namespace),
        drift detection reports each move instead.
        """
        info = detect_irqbalance(self.fs)
        changed = info != self._irqbalance
        self._irqbalance = info
        if info is None:
            if changed:
                self._banned, self._banned_before = frozenset(), None
            return
        ours = frozenset(self.planned_irqs(placement))
        if self.config.irqbalance != "ban" or not ours:
            if changed:
                log.info(
                    "irqbalance running %s",
                    format_fields(pid=info.pid, action="observe: report each move as drift"),
                )
            return
        if not changed and ours == self._banned:
            return
        # The ban command replaces irqbalance's whole socket list: keep what
        # others banned through it, and give exactly that back on restore.
        before = None if changed else self._banned_before
        if before is None:
            before = read_banned_irqs(info)
        if before is None or not ban_irqs(info, before | ours):
            self._banned = frozenset()
            self._fact(
                "irqbalance",
                None,
                f"irqbalance (pid {info.pid}) is running and its socket does not answer: "
                "it may move our IRQs; each move is reported as drift",
                log_message="irqbalance socket unreachable",
                level=logging.WARNING,
                log_fields={
                    "pid": info.pid,
                    "socket": info.socket_path or "@abstract",
                    "action": "observe: report each move as drift",
                },
                pid=info.pid,
                banned=False,
            )
            return
        self._banned_before = before
        self._banned = ours
        self._fact(
            "irqbalance",
            None,
            f"irqbalance (pid {info.pid}) asked to leave IRQs {format_cpulist(ours)} alone",
            log_message="irqbalance ban",
            log_fields={"pid": info.pid, "irqs": format_cpulist(ours), "action": "ban via socket"},
            pid=info.pid,
            banned=True,
            irqs=sorted(ours),
        )

    # -- observe and enforce -------------------------------------------------------

    def observe(self, placement: Placement) -> Mapping[ProcKey, tuple[IrqObservation, ...]]:
        """Where each rank's IRQs (`placement`'s) are delivered now, with the planned CPUs.

        `planned` is empty for an IRQ we do not keep (managed, refused, or
        binding off), so drift.diff skips it; the API still shows where it is.
        An IRQ newly seen off its CPUs is reported once per move with an event
        naming irqbalance when it runs and is not told to keep off.
        Blocking; call from the executor.
        """
        if not self.config.enabled:
            return MappingProxyType({})
        out: dict[ProcKey, tuple[IrqObservation, ...]] = {}
        with self._lock:
            for key, assignments in _irq_plan(placement).items():
                obs: list[IrqObservation] = []
                for a in assignments:
                    cpus = read_irq_delivery(self.fs, a.irq) or ()
                    kept = self._off_reason is None and self._status.get(a.irq) == "bound"
                    planned = a.cpus if kept else ()
                    obs.append(IrqObservation(a.irq, cpus, planned))
                    if kept and cpus:
                        self._note_move(key, a, cpus)
                out[key] = tuple(obs)
        return MappingProxyType(out)

    def _note_move(self, key: ProcKey, a: IrqAssignment, cpus: tuple[int, ...]) -> None:
        if set(cpus) <= set(a.cpus):
            self._moved.pop(a.irq, None)
            return
        if self._moved.get(a.irq) == cpus:
            return
        self._moved[a.irq] = cpus
        info = self._irqbalance
        if info is not None and a.irq not in self._banned:
            mover = f"irqbalance (pid {info.pid}) is running and does not keep off it"
        elif info is not None:
            mover = f"irqbalance (pid {info.pid}) was asked to keep off it; someone else"
        else:
            mover = "irqbalance is not running; someone else"
        label = key_label(key)
        self._facts.append(
            IrqFact(
                "irq_moved",
                key,
                f"{label}: irq {a.irq} ({a.owner}) moved to CPUs {format_cpulist(cpus)}, "
                f"planned {format_cpulist(a.cpus)}: {mover}",
                MappingProxyType(
                    {
                        "irq": a.irq,
                        "cpus": list(cpus),
                        "planned": list(a.cpus),
                        "irqbalance": None if info is None else info.pid,
                        "action": "drift finding",
                    }
                ),
                log_message="irq moved",
                level=logging.WARNING,
            )
        )

    def enforce(self, key: ProcKey, placement: Placement) -> tuple[IrqOutcome, ...]:
        """Re-write the IRQs of `key` that left `placement`'s CPUs (drift policy "enforce").

        Returns one outcome per IRQ tried; the caller records the re-binds. Blocking.
        """
        if not self.enabled:
            return ()
        outcomes: list[IrqOutcome] = []
        with self._lock:
            for a in _irq_plan(placement).get(key, ()):
                if self._off_reason is not None or self._status.get(a.irq) != "bound":
                    continue
                if not self._drifted(a):
                    continue
                outcomes.append(self._bind_one(key, a))
            if outcomes:
                # A restarted irqbalance has a new pid and an empty socket ban list.
                self._coordinate_irqbalance(placement)
        return tuple(outcomes)

    def _drifted(self, a: IrqAssignment) -> bool:
        """Drift by drift.diff's rule (`drift.irq_drifted`); a gone IRQ is nothing to put back."""
        return irq_drifted(read_irq_delivery(self.fs, a.irq) or (), a.cpus)

    # -- restore -----------------------------------------------------------

    def _restore_one(self, irq: int) -> None:
        try:
            self.binder.restore(irq)
        except KernelError as err:
            log.warning("irq restore failed %s", format_fields(irq=irq, error=err, action="leave"))
        self._status.pop(irq, None)

    def restore(self) -> list[tuple[int, KernelError | None]]:
        """Put every IRQ we changed back and give irqbalance its old ban list (best effort).

        One (irq, error or None) per IRQ; each failure is logged, none raised.
        Blocking; the daemon calls it after the processes stopped.
        """
        with self._lock:
            info = self._irqbalance
            if info is not None and self._banned:
                before = self._banned_before or frozenset()
                if not ban_irqs(info, before):
                    log.warning(
                        "irqbalance unban failed %s",
                        format_fields(pid=info.pid, irqs=format_cpulist(self._banned)),
                    )
                self._banned = frozenset()
            results = self.binder.restore_all()
            failed = 0
            for irq, err in results:
                self._status.pop(irq, None)
                if err is not None and err.reason != "gone":
                    failed += 1
                    log.warning(
                        "irq restore failed %s", format_fields(irq=irq, error=err, action="leave")
                    )
            if results:
                restored = [irq for irq, err in results if err is None]
                self._fact(
                    "irq_restored",
                    None,
                    f"IRQs {format_cpulist(restored) or '-'} back on their original CPUs"
                    + (f"; {failed} failed" if failed else ""),
                    log_message="irq restored",
                    log_fields={"irqs": format_cpulist(restored) or None, "failed": failed},
                    irqs=restored,
                    failed=failed,
                )
        return results
