"""Prometheus metrics (DESIGN 3.5) rendered from the state snapshot (no I/O).

`build_registry(store)` returns the daemon's own registry (never the global
one) holding one `SnapshotCollector`, which turns `store.snapshot` into metric
families at scrape time. `collect()` reads the immutable snapshot only: no
/proc, no locks, nothing that can block the event loop.

Counters that alerts and dashboards take `increase()`/`rate()` of are
pre-initialised with 0 for every planned process and every known label value:
`increase()` needs two samples of a series, so a series that is born at 1
would hide its first failure (https://prometheus.io/docs/practices/instrumentation/
"Avoid missing metrics").

`placement_check_duration_seconds` is a summary without quantiles: `_count`
is the number of finished checks and `_sum` their total seconds, so
`rate(_sum[5m]) / rate(_count[5m])` is the mean check time; the last check's
own duration is the gauge `placement_last_check_duration_seconds`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import get_args

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from supervisor import __version__
from supervisor.state import (
    HOST_LABEL,
    BindTarget,
    DriftKind,
    MemPolicyStep,
    ProcessState,
    ProcessStatus,
    ProcKey,
    Snapshot,
    StateStore,
    key_label,
)

PROCESS_STATES: tuple[str, ...] = get_args(ProcessState)
MEMPOLICY_STEPS: tuple[str, ...] = get_args(MemPolicyStep)
DRIFT_KINDS: tuple[str, ...] = get_args(DriftKind)
BIND_TARGETS: tuple[str, ...] = get_args(BindTarget)
# KernelError.reason values (supervisor.errors); "managed" only happens on IRQs.
BIND_REASONS: tuple[str, ...] = ("gone", "denied", "invalid", "error")
IRQ_ONLY_REASONS: tuple[str, ...] = ("managed",)
# Re-bind reasons pre-initialised for every process: those the daemon and the
# check loop count under (the drift kind that was corrected, a new thread put
# in its role, a cpuset change, an API call). Other values still appear, from
# their first count.
REBIND_REASONS: tuple[str, ...] = (
    "api",
    "thread_affinity",
    "thread_role",
    "memory_locality",
    "irq_affinity",
    "cpuset_changed",
)


def collected_parts(snap: Snapshot) -> tuple[object, ...]:
    """Every snapshot field the collector reads: the API renders /metrics again
    only when one of these is a new object (an event alone changes none).
    Keep it next to _families: a field read there and missing here would serve
    a stale body."""
    return (
        snap.placement,
        snap.processes,
        snap.observed,
        snap.drift,
        snap.counters,
        snap.accelerator_kind,
        snap.started_at,
        snap.stopping,
    )


def _bind_failure_labels(key: ProcKey) -> Iterator[tuple[str, str, str]]:
    rank = key_label(key)
    for target in BIND_TARGETS:
        if target == "irq" and key == "engine":
            continue  # the engine owns no device, so no IRQs are bound for it
        reasons = BIND_REASONS + (IRQ_ONLY_REASONS if target == "irq" else ())
        for reason in reasons:
            yield (rank, target, reason)


class SnapshotCollector(Collector):
    """Renders `store.snapshot` as the `placement_*` metric families."""

    def __init__(self, store: StateStore) -> None:
        self._store = store

    def describe(self) -> Iterable[Metric]:
        # Names only: registration must not depend on what the snapshot holds.
        return list(_families(None))

    def collect(self) -> Iterable[Metric]:
        return list(_families(self._store.snapshot))


def build_registry(store: StateStore) -> CollectorRegistry:
    """A registry of the daemon's own holding the snapshot collector only."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SnapshotCollector(store))
    return registry


def not_ready_reasons(snap: Snapshot) -> list[str]:
    """Why the daemon is not ready ([] when it is): what /readyz and placement_ready say.

    Stricter than `Snapshot.ready` alone: a planned process that has no status
    yet is not ready either.
    """
    if snap.stopping:
        return ["the supervisor is stopping"]
    reasons: list[str] = []
    planned = snap.keys()  # a Snapshot method, not a dict view
    for key in planned:
        status = snap.processes.get(key)
        if status is None:
            reasons.append(f"{key_label(key)}: not started yet")
        elif status.state != "running":
            reasons.append(f"{key_label(key)}: {status.state}")
        elif not status.bound:
            reasons.append(f"{key_label(key)}: running but not bound as planned")
    if not reasons and not snap.ready:
        reasons.append("a supervised process is not running and bound")
    return reasons


def _families(snap: Snapshot | None) -> Iterator[Metric]:
    info = InfoMetricFamily(
        "placement",
        "The supervisor's version, planning strategy and accelerator kind (value 1).",
        labels=(),
    )
    up = GaugeMetricFamily(
        "placement_up", "1 when the process is running, else 0.", labels=("rank",)
    )
    bound = GaugeMetricFamily(
        "placement_bound",
        "1 when every bind of the plan was applied to the process and read back.",
        labels=("rank",),
    )
    state = GaugeMetricFamily(
        "placement_process_state",
        "1 for the process's current state (starting, running, backoff, failed, stopped).",
        labels=("rank", "state"),
    )
    backoff = GaugeMetricFamily(
        "placement_backoff_seconds",
        "Delay before the next start while the process is in restart backoff, else 0.",
        labels=("rank",),
    )
    mempolicy = GaugeMetricFamily(
        "placement_mempolicy",
        "1 for the memory-policy step the process got from the kernel (bind, preferred, none).",
        labels=("rank", "policy"),
    )
    restarts = CounterMetricFamily(
        "placement_restarts", "Restarts of the process by the supervisor.", labels=("rank",)
    )
    ratio = GaugeMetricFamily(
        "placement_local_memory_ratio",
        "Resident memory on the planned nodes / all resident memory (0..1).",
        labels=("rank",),
    )
    memory = GaugeMetricFamily(
        "placement_memory_bytes",
        "Resident memory of the process per NUMA node.",
        labels=("rank", "node"),
    )
    threads = GaugeMetricFamily(
        "placement_threads", "Threads of the process per role.", labels=("rank", "role")
    )
    planned = GaugeMetricFamily(
        "placement_planned_cpus", "CPUs the plan gives each role.", labels=("rank", "role")
    )
    findings = GaugeMetricFamily(
        "placement_drift_findings",
        "Current differences between the plan and live state, by kind.",
        labels=("rank", "kind"),
    )
    bind_failures = CounterMetricFamily(
        "placement_bind_failures",
        "Binds the kernel refused, by target (process, thread, memory, irq, cgroup) and reason.",
        labels=("rank", "target", "reason"),
    )
    host_bind_failures = CounterMetricFamily(
        "placement_host_bind_failures",
        "Binds of the supervisor's own (instance cgroup, IRQ re-plan) the kernel refused; "
        "DESIGN 3.5 keeps `rank` for ranks and the engine.",
        labels=("target", "reason"),
    )
    drift_events = CounterMetricFamily(
        "placement_drift_events", "Drift findings seen by the checks.", labels=("rank", "kind")
    )
    rebinds = CounterMetricFamily(
        "placement_rebinds", "Re-binds applied, by reason.", labels=("rank", "reason")
    )
    cpuset_changes = CounterMetricFamily(
        "placement_cpuset_changes", "Changes of the supervisor's allowed cpuset seen."
    )
    adoptions = CounterMetricFamily(
        "placement_adoptions", "Engine-spawned workers adopted by the rank.", labels=("rank",)
    )
    unnamed = CounterMetricFamily(
        "placement_unnamed_processes",
        "Processes of the engine's tree that no rank_from source named.",
    )
    last_check = GaugeMetricFamily(
        "placement_last_check_timestamp_seconds",
        "Unix time the last placement check finished (0 before the first).",
    )
    last_duration = GaugeMetricFamily(
        "placement_last_check_duration_seconds", "How long the last placement check took."
    )
    start_time = GaugeMetricFamily(
        "placement_start_time_seconds", "Unix time the supervisor started."
    )
    ready = GaugeMetricFamily(
        "placement_ready", "1 when every process is running and bound (what /readyz answers)."
    )
    # A summary without quantiles: the count and total of all checks.
    check_duration = SummaryMetricFamily(
        "placement_check_duration_seconds",
        "Placement checks finished (_count) and the seconds they took (_sum).",
    )

    if snap is not None:
        counters = snap.counters
        info.add_metric(
            [],
            {
                "version": __version__,
                "strategy": snap.placement.strategy,
                "accelerator": snap.accelerator_kind,
            },
        )
        last_check.add_metric([], counters.last_check_at)
        last_duration.add_metric([], counters.last_check_duration_s)
        start_time.add_metric([], snap.started_at)
        ready.add_metric([], 0.0 if not_ready_reasons(snap) else 1.0)
        cpuset_changes.add_metric([], counters.cpuset_changes)
        unnamed.add_metric([], counters.unnamed_processes)
        for rank, n in sorted(counters.adoptions.items()):
            adoptions.add_metric([rank], n)

        failures: dict[tuple[str, str, str], int] = {}
        drifts: dict[tuple[str, str], int] = {}
        rebind_counts: dict[tuple[str, str], int] = {}
        keys = snap.keys()  # a Snapshot method, not a dict view
        for key in keys:
            rank = key_label(key)
            status = snap.processes.get(key) or ProcessStatus(key)
            up.add_metric([rank], 1.0 if status.state == "running" else 0.0)
            bound.add_metric([rank], 1.0 if status.bound else 0.0)
            for name in PROCESS_STATES:
                state.add_metric([rank, name], 1.0 if status.state == name else 0.0)
            backoff.add_metric([rank], status.backoff_s if status.state == "backoff" else 0.0)
            if status.mempolicy is not None:
                for step in MEMPOLICY_STEPS:
                    mempolicy.add_metric([rank, step], 1.0 if status.mempolicy == step else 0.0)
            restarts.add_metric([rank], counters.restarts.get(rank, status.restarts))

            slot = snap.placement.slot(key)
            for role, cpus in sorted(slot.roles.items()):
                planned.add_metric([rank, role], len(cpus))

            obs = snap.observed.get(key)
            if obs is not None:
                if obs.local_memory_ratio is not None:
                    ratio.add_metric([rank], obs.local_memory_ratio)
                for node, size in sorted(obs.memory_bytes_by_node.items()):
                    memory.add_metric([rank, str(node)], size)
                per_role: dict[str, int] = {}
                for t in obs.threads:
                    per_role[t.role] = per_role.get(t.role, 0) + 1
                for role, n in sorted(per_role.items()):
                    threads.add_metric([rank, role], n)

            current: dict[str, int] = dict.fromkeys(DRIFT_KINDS, 0)
            for f in snap.drift.get(key, ()):
                current[f.kind] = current.get(f.kind, 0) + 1
            for kind, n in current.items():
                findings.add_metric([rank, kind], n)

            failures.update(dict.fromkeys(_bind_failure_labels(key), 0))
            drifts.update(dict.fromkeys(((rank, kind) for kind in DRIFT_KINDS), 0))
            rebind_counts.update(dict.fromkeys(((rank, r) for r in REBIND_REASONS), 0))

        failures.update(counters.bind_failures)
        drifts.update(counters.drift_events)
        rebind_counts.update(counters.rebinds)
        for labels, n in sorted(failures.items()):
            if labels[0] == HOST_LABEL:
                host_bind_failures.add_metric(list(labels[1:]), n)
            else:
                bind_failures.add_metric(list(labels), n)
        for labels2, n in sorted(drifts.items()):
            drift_events.add_metric(list(labels2), n)
        for labels2, n in sorted(rebind_counts.items()):
            rebinds.add_metric(list(labels2), n)
        check_duration.add_metric([], counters.checks, counters.check_seconds_sum)

    yield info
    yield ready
    yield up
    yield bound
    yield state
    yield backoff
    yield mempolicy
    yield restarts
    yield ratio
    yield memory
    yield threads
    yield planned
    yield findings
    yield bind_failures
    yield host_bind_failures
    yield drift_events
    yield rebinds
    yield cpuset_changes
    yield adoptions
    yield unnamed
    yield check_duration
    yield last_check
    yield last_duration
    yield start_time
