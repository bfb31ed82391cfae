"""The one recorder: each fact counted, emitted as an event and logged once (no I/O
beyond logging).

Every counted fact of the check loop (a drift finding, a re-bind, a memory
migration, a bind failure) goes through `Recorder`, which bumps its counter in
the `StateStore`, emits its event and writes its STYLE log line
(`key=value ... action=`) together, so the three never disagree. Call it from
the event loop only (the store has one writer). The vocabulary (event kinds,
label values) is in supervisor.state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from supervisor.cpulist import format_cpulist
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey, key_label
from supervisor.procfs.identity import ProcessId
from supervisor.state import (
    HOST_LABEL,
    BindTarget,
    DriftKind,
    EventKind,
    Finding,
    ProcessState,
    RebindReason,
    StateStore,
)

log = logging.getLogger("placement_supervisor.checker")

EVENT_TARGETS_MAX = 20  # targets named in one grouped event


class BoundThread(Protocol):
    """A thread that was re-bound (supervisor.watch.decide.ThreadBind)."""

    @property
    def tid(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def cpus(self) -> tuple[int, ...]: ...


class FactLike(Protocol):
    """A fact a collaborator kept for the loop to record (supervisor.watch.irqs.IrqFact)."""

    @property
    def kind(self) -> EventKind: ...
    @property
    def key(self) -> ProcKey | None: ...
    @property
    def message(self) -> str: ...
    @property
    def fields(self) -> Mapping[str, Any]: ...
    @property
    def log_message(self) -> str | None: ...
    @property
    def level(self) -> int: ...
    @property
    def log_fields(self) -> Mapping[str, Any] | None: ...
    @property
    def failure(self) -> str | None: ...


def _more_suffix(total: int, shown: int) -> str:
    """The " (+N more)" of an event that names only the first `shown` of `total` targets."""
    return f" (+{total - shown} more)" if total > shown else ""


class Recorder:
    """Counts, emits and logs (on the loop). One method per kind of fact."""

    def __init__(self, store: StateStore, logger: logging.Logger | None = None) -> None:
        self.store = store
        self.log = logger if logger is not None else log

    # -- failures ---------------------------------------------------------------------

    def bind_failed(
        self,
        key: ProcKey | None,
        target: BindTarget,
        reason: str,
        message: str,
        *,
        what: str | None = None,
        action: str = "retry",
        event_message: str | None = None,
        **fields: Any,
    ) -> None:
        """bind_failures{rank,target,reason} (rank "supervisor" when `key` is None)."""
        label = HOST_LABEL if key is None else key_label(key)
        self.store.count("bind_failures", (label, target, reason))
        text = message if key is None else f"{label}: {target} bind failed: {message}"
        if event_message is not None:
            text = event_message
        extra = {"what": what} if what is not None else {}
        self.store.emit("bind_failed", key, text, target=target, reason=reason, **extra, **fields)
        self.log.warning(
            "bind failed %s",
            format_fields(
                **({} if key is None else {"rank": label}),
                target=target,
                **({} if what is None else {"what": what}),
                reason=reason,
                error=message,
                action=action,
            ),
        )

    def error(
        self,
        message: str,
        error: str,
        *,
        what: str,
        action: str,
        exc: BaseException | None = None,
    ) -> None:
        """A failure of a task itself, not of one bind: an event and a log line
        (at ERROR with the traceback of `exc` when given)."""
        self.store.emit("error", None, message, error=error)
        if exc is not None:
            self.log.error(
                "%s failed %s", what, format_fields(error=error, action=action), exc_info=exc
            )
        else:
            self.log.warning("%s failed %s", what, format_fields(error=error, action=action))

    # -- drift ------------------------------------------------------------------------

    def drift(self, key: ProcKey, found: Sequence[Finding], outcomes: Mapping[str, str]) -> None:
        """New findings, grouped by kind: counted, one event per kind naming the targets."""
        by_kind: dict[DriftKind, list[Finding]] = {}
        for f in found:
            by_kind.setdefault(f.kind, []).append(f)
        label = key_label(key)
        for kind, group in by_kind.items():
            self.store.count("drift_events", (label, kind), len(group))
            shown = group[:EVENT_TARGETS_MAX]
            detail = "; ".join(
                f"{f.target} expected {f.expected} got {f.actual}: {outcomes[f.target]}"
                for f in shown
            )
            self.store.emit(
                "drift",
                key,
                f"{label}: {kind} drift: {detail}{_more_suffix(len(group), len(shown))}",
                drift=kind,
                targets=[f.target for f in shown],
                expected=[f.expected for f in shown],
                actual=[f.actual for f in shown],
                outcome=[outcomes[f.target] for f in shown],
                count=len(group),
            )
            first = shown[0]
            self.log.info(
                "drift %s",
                format_fields(
                    rank=label,
                    kind=kind,
                    count=len(group),
                    first=first.target,
                    expected=first.expected,
                    actual=first.actual,
                    action=outcomes[first.target],
                ),
            )

    def process_down(self, key: ProcKey, state: str) -> None:
        label = key_label(key)
        self.store.count("drift_events", (label, "process_gone"))
        self.store.emit(
            "drift",
            key,
            f"{label}: process not running ({state})",
            drift="process_gone",
            targets=["process"],
            outcome="observe",
        )
        self.log.info(
            "drift %s",
            format_fields(rank=label, kind="process_gone", state=state, action="observe"),
        )

    # -- re-binds ---------------------------------------------------------------------

    def threads_rebound(
        self,
        key: ProcKey,
        reason: RebindReason,
        done: Sequence[BoundThread],
        *,
        by_cgroup: int = 0,
    ) -> None:
        """rebinds{rank,reason} += threads re-bound; `by_cgroup` more that the
        process's cgroup cpuset write already put on their new CPUs (a re-plan)."""
        label = key_label(key)
        total = len(done) + by_cgroup
        if total == 0:
            return
        self.store.count("rebinds", (label, reason), total)
        shown = done[:EVENT_TARGETS_MAX]
        names = ", ".join(f"{b.tid} ({b.name}) -> {b.role} {format_cpulist(b.cpus)}" for b in shown)
        text = f"{label}: re-bound {total} thread(s) [{reason}]"
        if by_cgroup:
            text += f", {by_cgroup} by its cgroup's cpuset"
        if shown:
            text += f": {names}{_more_suffix(len(done), len(shown))}"
        self.store.emit(
            "rebind",
            key,
            text,
            reason=reason,
            threads=total,
            tids=[b.tid for b in shown],
            by_cgroup=by_cgroup,
        )
        self.log.info(
            "rebind %s",
            format_fields(
                rank=label,
                reason=reason,
                threads=total,
                **({"by_cgroup": by_cgroup} if by_cgroup else {}),
                **({"first": shown[0].tid} if shown else {}),
                action="bound",
            ),
        )

    def memory_migrated(
        self,
        key: ProcKey,
        *,
        pid: int,
        reason: RebindReason,
        from_nodes: Sequence[int],
        to_nodes: Sequence[int],
        remote_bytes: int,
        ratio: float,
        pages_left: int,
    ) -> None:
        label = key_label(key)
        self.store.count("rebinds", (label, reason))
        self.store.emit(
            "rebind",
            key,
            f"{label}: migrated memory from node {format_cpulist(from_nodes)} to node "
            f"{format_cpulist(to_nodes)} ({remote_bytes >> 20} MiB remote, "
            f"ratio {ratio:.3f}; {pages_left} pages not moved)",
            reason=reason,
            from_nodes=list(from_nodes),
            to_nodes=list(to_nodes),
            remote_bytes=remote_bytes,
            ratio=ratio,
            pages_left=pages_left,
        )
        self.log.info(
            "migrate %s",
            format_fields(
                rank=label,
                pid=pid,
                reason=reason,
                from_nodes=format_cpulist(from_nodes),
                to_nodes=format_cpulist(to_nodes),
                remote_mib=remote_bytes >> 20,
                pages_left=pages_left,
                action="migrated",
            ),
        )

    def cgroup_repaired(self, key: ProcKey, reason: RebindReason, pids: Sequence[int]) -> None:
        """rebinds{rank,reason="cgroup"} += 1: the process's cgroup made as planned
        again and its processes put back (each repair, not only the first finding)."""
        label = key_label(key)
        self.store.count("rebinds", (label, reason))
        text = f"{label}: cgroup repaired, {len(pids)} process(es) put back"
        self.store.emit("rebind", key, text, reason=reason, pids=list(pids))
        self.log.info(
            "cgroup_repair %s",
            format_fields(rank=label, reason=reason, pids=len(pids), action="repaired"),
        )

    def irq_rebound(
        self, key: ProcKey, reason: RebindReason, irq: int, cpus: Sequence[int]
    ) -> None:
        label = key_label(key)
        self.store.count("rebinds", (label, reason))
        self.store.emit(
            "rebind",
            key,
            f"{label}: irq {irq} put back on CPUs {format_cpulist(cpus)}",
            irq=irq,
            cpus=list(cpus),
            reason=reason,
        )
        self.log.info(
            "irq rebind %s",
            format_fields(
                rank=label, irq=irq, cpus=format_cpulist(cpus), reason=reason, action="bound"
            ),
        )

    def facts(self, facts: Sequence[FactLike]) -> None:
        """A collaborator's facts (the IRQ keeper's), in order."""
        for f in facts:
            if f.failure is not None:
                fields = dict(f.fields)
                action = str(fields.pop("action", "skip"))
                self.bind_failed(
                    f.key,
                    "irq",
                    f.failure,
                    f.message,
                    action=action,
                    event_message=f.message,
                    **fields,
                )
            else:
                self.note(
                    f.kind,
                    f.key,
                    f.message,
                    log_message=f.log_message,
                    level=f.level,
                    log_fields=f.log_fields,
                    **f.fields,
                )

    # -- events that count nothing -------------------------------------------------

    def note(
        self,
        kind: EventKind | ProcessState,
        key: ProcKey | None,
        message: str,
        *,
        log_message: str | None = None,
        level: int = logging.INFO,
        log_fields: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        """An event; with `log_message`, its log line too: `log_message rank=... k=v ...`.

        The line carries the event's fields (an `action` field last), or
        `log_fields` where the two read differently (a cpulist, not a list).
        Without `log_message` the event is the whole record: a runner's state
        change, which the fact that caused it (spawn, exit, ...) logs.
        """
        self.store.emit(kind, key, message, **fields)
        if log_message is None:
            return
        shown = dict(fields if log_fields is None else log_fields)
        action = shown.pop("action", None)
        line = {"rank": None if key is None else key_label(key), **shown, "action": action}
        self.log.log(
            level,
            "%s %s",
            log_message,
            format_fields(**{k: v for k, v in line.items() if v is not None}),
        )

    # -- processes: counted facts ------------------------------------------------------

    def restart_scheduled(self, key: ProcKey, reason: str, delay_s: float, restarts: int) -> None:
        """restarts{rank} += 1; WARNING: a restart nobody asked for."""
        label = key_label(key)
        self.store.count("restarts", label)
        self.note(
            "restart",
            key,
            f"{label}: {reason}; restart in {delay_s:g}s",
            log_message="restart scheduled",
            level=logging.WARNING,
            delay_s=delay_s,
            reason=reason,
            restarts=restarts,
            action="backoff",
        )

    def adopted(
        self,
        key: ProcKey,
        *,
        pid: int,
        ppid: int | None,
        cpus: Sequence[int],
        cgroup: str | None,
        moved: int,
        bound: bool,
    ) -> None:
        """adoptions{rank} += 1: an engine-spawned worker bound to its rank's slot."""
        label = key_label(key)
        self.store.count("adoptions", label)
        self.note(
            "adopt",
            key,
            f"{label}: adopted pid {pid} (ppid {ppid}) cpus={format_cpulist(cpus)}",
            log_message="adopt",
            log_fields={
                "pid": pid,
                "ppid": ppid,
                "cpus": format_cpulist(cpus),
                "cgroup": cgroup,
                "bound": str(bound).lower(),
                "action": "bound to the rank's slot",
            },
            pid=pid,
            ppid=ppid,
            cpus=list(cpus),
            cgroup=cgroup,
            moved=moved,
            bound=bound,
        )

    def unnamed(self, ident: ProcessId) -> None:
        """unnamed_processes += 1: an engine process no `rank_from` source named for long."""
        c = self.store.snapshot.counters
        self.store.update(counters=replace(c, unnamed_processes=c.unnamed_processes + 1))
        self.log.info(
            "unnamed process %s",
            format_fields(
                pid=ident.pid, start_time=ident.start_time, action="leave it the engine's"
            ),
        )

    def process_read_failed(self) -> None:
        """process_read_failures += 1: a process's /proc files there but unreadable
        (trees.tree.ReadFailures logs it, at most once a minute)."""
        c = self.store.snapshot.counters
        self.store.update(counters=replace(c, process_read_failures=c.process_read_failures + 1))

    def restart_counted(self, key: ProcKey) -> None:
        """restarts{rank} and restarts_requested{rank} += 1 for a restart asked for (the
        API's, a reload's), not scheduled."""
        self.store.count("restarts", key_label(key))
        self.store.count("restarts_requested", key_label(key))

    def cpuset_changed(
        self,
        old_cpus: frozenset[int],
        old_mems: frozenset[int],
        new_cpus: frozenset[int],
        new_mems: frozenset[int],
        action: str,
    ) -> None:
        c = self.store.snapshot.counters
        self.store.update(counters=replace(c, cpuset_changes=c.cpuset_changes + 1))
        self.store.emit(
            "cpuset",
            None,
            f"supervisor cpuset changed: cpus {format_cpulist(old_cpus)} -> "
            f"{format_cpulist(new_cpus)}, mems {format_cpulist(old_mems)} -> "
            f"{format_cpulist(new_mems)}",
            old_cpus=sorted(old_cpus),
            new_cpus=sorted(new_cpus),
            old_mems=sorted(old_mems),
            new_mems=sorted(new_mems),
            action=action,
        )
        self.log.warning(
            "cpuset changed %s",
            format_fields(
                old_cpus=format_cpulist(old_cpus),
                new_cpus=format_cpulist(new_cpus),
                old_mems=format_cpulist(old_mems),
                new_mems=format_cpulist(new_mems),
                action=action,
            ),
        )
