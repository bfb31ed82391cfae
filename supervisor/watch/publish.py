"""Publication: what a settled decision did, through the one recorder (on the loop).

`record_settled` turns one `settle.Settled` into counted events and log lines
(re-binds by reason, migrations, IRQ re-writes, new bind failures, new
drift); `summary_of` is the pass's answer for one process (POST /rebind
returns it); `publish_down` reports planned processes that are not running.
Writes the StateStore only through `events.Recorder`; call from the loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from supervisor.events import Recorder
from supervisor.plan.keys import ProcKey, key_label
from supervisor.state import Finding, Observation, Supervised
from supervisor.watch.decide import Decision
from supervisor.watch.settle import Outcomes, Settled, drift_outcomes


def record_settled(
    record: Recorder,
    d: Decision,
    s: Settled,
    out: Outcomes,
    *,
    moved: bool = False,
    by_plan: int = 0,
) -> None:
    """Every fact of one settled decision. `moved`: a new plan moved the process;
    `by_plan`: threads its cgroup write moved (counted with the cpuset_changed
    re-binds: what happened)."""
    key = d.key
    for reason, done in s.rebound.items():
        record.threads_rebound(
            key, reason, done, by_cgroup=by_plan if reason == "cpuset_changed" else 0
        )
    if by_plan and "cpuset_changed" not in s.rebound:
        record.threads_rebound(key, "cpuset_changed", (), by_cgroup=by_plan)
    for m, left in s.migrated:
        record.memory_migrated(
            key,
            pid=m.pid,
            reason=m.reason,
            from_nodes=m.from_nodes,
            to_nodes=m.to_nodes,
            remote_bytes=m.remote_bytes,
            ratio=m.ratio,
            pages_left=left,
        )
    if d.irq_reason is not None and out.irqs is not None:
        for irq, cpus in out.irqs.irqs_bound:
            record.irq_rebound(key, d.irq_reason, irq, cpus)
    if s.cgroup_repaired and d.cgroup is not None:
        record.cgroup_repaired(key, d.cgroup.reason, d.cgroup.pids)
    for f in s.failures:
        record.bind_failed(key, f.target, f.reason, f.message, what=f.what)
    record.drift(key, d.new_drift, drift_outcomes(d.new_drift, s.fixed, s.failed))
    if moved and not s.rebound and not by_plan:
        record.note(
            "rebind",
            key,
            f"{key_label(key)}: moved with the new plan; no thread needed a re-bind",
            reason="cpuset_changed",
            threads=0,
        )


def summary_of(pid: int, d: Decision, s: Settled) -> dict[str, Any]:
    return {
        "pid": pid,
        "state": "running",
        "findings": [f.to_doc() for f in d.findings],
        "threads_rebound": sum(len(b) for b in s.rebound.values()),
        "memory_migrations": len(s.migrated),
        "irqs_rebound": s.irqs_rebound,
        "failed": sorted(s.failed),
        "drift": [f.to_doc() for f in s.remaining],
    }


def publish_down(
    record: Recorder,
    supervised: Iterable[Supervised],
    reported: set[ProcKey],
    only: ProcKey | None,
    results: dict[ProcKey, tuple[Observation, tuple[Finding, ...]]],
) -> dict[str, Any]:
    """Planned processes that are not running: a process_gone finding, counted once
    (`reported` holds those already counted, until they run again)."""
    out: dict[str, Any] = {}
    for key, status, _ in supervised:
        if (only is not None and key != only) or status.state not in (
            "backoff",
            "failed",
            "stopped",
        ):
            continue
        finding = Finding("process_gone", "process", "running", status.state)
        if key not in reported:
            reported.add(key)
            record.process_down(key, status.state)
        results[key] = (Observation(observed_at=time.time()), (finding,))
        out[key_label(key)] = {"state": status.state, "findings": [finding.to_doc()]}
    return out
