"""The `placement_*` metric families (contracts §5), each a function of its inputs (no I/O).

`FAMILIES` is the exposition, in order. A family is one function registered
with `@FAMILIES.add(kind, name, help, labels)`; its parameters after the
metric are the Snapshot/Counters fields it reads (supervisor.serve.exposition),
which is all the incremental renderer needs to know. To add a family, add a
function here (a configured value it shows goes into the snapshot first, so
the function can name it). `build_registry(store)` returns the daemon's own registry
(never the global one) holding one `SnapshotCollector`.

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

from collections.abc import Iterator, Mapping
from typing import get_args

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    SummaryMetricFamily,
)

from supervisor import __version__
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Placement
from supervisor.serve.config_metrics import register_config_families
from supervisor.serve.documents import process_keys, readiness
from supervisor.serve.exposition import FamilyTable, SnapshotCollector
from supervisor.state import BIND_REASONS as ALL_BIND_REASONS
from supervisor.state import (
    CAPABILITY_NAMES,
    HOST_LABEL,
    HTTP_BAD_REASONS,
    BindTarget,
    Capability,
    CapabilityName,
    DriftKind,
    Finding,
    MemPolicyStep,
    Observation,
    ProcessState,
    ProcessStatus,
    SelfUsage,
    StateStore,
    capabilities_in_force,
)
from supervisor.topology.model import Topology

PROCESS_STATES: tuple[str, ...] = get_args(ProcessState)
MEMPOLICY_STEPS: tuple[str, ...] = get_args(MemPolicyStep)
DRIFT_KINDS: tuple[str, ...] = get_args(DriftKind)
BIND_TARGETS: tuple[str, ...] = get_args(BindTarget)
# The bind failure reasons of supervisor.state; "managed" only happens on IRQs.
IRQ_ONLY_REASONS: tuple[str, ...] = ("managed",)
# The supervisor's own binds that can fail (checker: the IRQ re-plan and the
# instance cgroup), always counted with reason "error"; pre-initialised too.
HOST_BIND_FAILURES: tuple[tuple[str, str], ...] = (("cgroup", "error"), ("irq", "error"))
BIND_REASONS: tuple[str, ...] = tuple(r for r in ALL_BIND_REASONS if r not in IRQ_ONLY_REASONS)
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
    "cgroup",  # a cgroup repair: re-made and its processes put back
)

Processes = Mapping[ProcKey, ProcessStatus]
Observed = Mapping[ProcKey, Observation]
Capabilities = Mapping[CapabilityName, Capability]

FAMILIES = FamilyTable()


def _statuses(placement: Placement, processes: Processes) -> Iterator[tuple[str, ProcessStatus]]:
    """(rank label, status) of every planned process; "starting" until it has one."""
    for key in process_keys(placement):
        yield key_label(key), processes.get(key) or ProcessStatus(key)


def _bind_failure_labels(key: ProcKey) -> Iterator[tuple[str, str, str]]:
    rank = key_label(key)
    for target in BIND_TARGETS:
        if target == "irq" and key == "engine":
            continue  # the engine owns no device, so no IRQs are bound for it
        reasons = BIND_REASONS + (IRQ_ONLY_REASONS if target == "irq" else ())
        for reason in reasons:
            yield (rank, target, reason)


# -- the daemon -----------------------------------------------------------------------


@FAMILIES.add(
    "info",
    "placement",
    "The supervisor's version, planning strategy and accelerator kind (value 1).",
)
def _info(m: InfoMetricFamily, placement: Placement, accelerator_kind: str) -> None:
    labels = {"version": __version__, "strategy": placement.strategy}
    m.add_metric([], labels | {"accelerator": accelerator_kind})


@FAMILIES.add(
    "gauge", "placement_ready", "1 when every process is running and bound (what /readyz answers)."
)
def _ready(
    m: GaugeMetricFamily, placement: Placement, processes: Processes, stopping: bool
) -> None:
    m.add_metric([], 0.0 if readiness(placement, processes, stopping) else 1.0)


@FAMILIES.add(
    "gauge",
    "placement_capability",
    "1 when the host lets the supervisor bind this (mempolicy, cgroup, irq; probed at start), "
    "else 0. Not in readiness: see placement_capability_wanted and GET /placement.",
    ("name",),
)
def _capability(m: GaugeMetricFamily, capabilities: Capabilities) -> None:
    for name in CAPABILITY_NAMES:
        cap = capabilities.get(name)
        if cap is not None:
            m.add_metric([name], 1.0 if cap.available else 0.0)


@FAMILIES.add(
    "gauge",
    "placement_capability_wanted",
    "1 when this kind of binding is wanted (mempolicy; cgroup = auto; irq: irq.enabled "
    "and the plan in force has IRQs to bind), else 0.",
    ("name",),
)
def _capability_wanted(
    m: GaugeMetricFamily, capabilities: Capabilities, placement: Placement
) -> None:
    in_force = capabilities_in_force(capabilities, placement)
    for name in CAPABILITY_NAMES:
        cap = in_force.get(name)
        if cap is not None:
            m.add_metric([name], 1.0 if cap.wanted else 0.0)


@FAMILIES.add(
    "gauge",
    "placement_numa_balancing",
    "kernel.numa_balancing as read at start (0 off, 1 AutoNUMA, 2 tiering); absent when the "
    "kernel has none. See docs/operations.md for what it does to bound processes.",
)
def _numa_balancing(m: GaugeMetricFamily, topology: Topology) -> None:
    if topology.numa_balancing is not None:
        m.add_metric([], float(topology.numa_balancing))


# -- each process's state ---------------------------------------------------------------


@FAMILIES.add("gauge", "placement_up", "1 when the process is running, else 0.", ("rank",))
def _up(m: GaugeMetricFamily, placement: Placement, processes: Processes) -> None:
    for rank, status in _statuses(placement, processes):
        m.add_metric([rank], 1.0 if status.state == "running" else 0.0)


@FAMILIES.add(
    "gauge",
    "placement_bound",
    "1 when every bind of the plan was applied to the process and read back.",
    ("rank",),
)
def _bound(m: GaugeMetricFamily, placement: Placement, processes: Processes) -> None:
    for rank, status in _statuses(placement, processes):
        m.add_metric([rank], 1.0 if status.bound else 0.0)


@FAMILIES.add(
    "gauge",
    "placement_process_state",
    "1 for the process's current state (starting, running, backoff, failed, stopped, "
    "waiting, stopping).",
    ("rank", "state"),
)
def _state(m: GaugeMetricFamily, placement: Placement, processes: Processes) -> None:
    for rank, status in _statuses(placement, processes):
        for name in PROCESS_STATES:
            m.add_metric([rank, name], 1.0 if status.state == name else 0.0)


@FAMILIES.add(
    "gauge",
    "placement_down_since_timestamp_seconds",
    "Unix time the process stopped running (or, if it never ran, the supervisor started "
    "or first started it); 0 while it runs. Starting, backoff and starting again keep it.",
    ("rank",),
)
def _down_since(
    m: GaugeMetricFamily, placement: Placement, processes: Processes, started_at: float
) -> None:
    for rank, status in _statuses(placement, processes):
        if status.state == "running":
            m.add_metric([rank], 0.0)
        else:
            m.add_metric([rank], status.down_since if status.down_since is not None else started_at)


@FAMILIES.add(
    "gauge",
    "placement_ready_timeout_seconds",
    "ready.timeout_s: how long the engine may load before its start counts as failed "
    "(alert PlacementRankNotUp waits that long for a starting process); absent without "
    "a [ready] probe.",
)
def _ready_timeout(m: GaugeMetricFamily, ready_timeout_s: float | None) -> None:
    if ready_timeout_s is not None:
        m.add_metric([], ready_timeout_s)


@FAMILIES.add(
    "gauge",
    "placement_backoff_seconds",
    "Delay before the next start while the process is in restart backoff, else 0.",
    ("rank",),
)
def _backoff(m: GaugeMetricFamily, placement: Placement, processes: Processes) -> None:
    for rank, status in _statuses(placement, processes):
        m.add_metric([rank], status.backoff_s if status.state == "backoff" else 0.0)


@FAMILIES.add(
    "gauge",
    "placement_mempolicy",
    "1 for the memory-policy step the process got from the kernel (bind, preferred, none).",
    ("rank", "policy"),
)
def _mempolicy(m: GaugeMetricFamily, placement: Placement, processes: Processes) -> None:
    for rank, status in _statuses(placement, processes):
        if status.mempolicy is not None:
            for step in MEMPOLICY_STEPS:
                m.add_metric([rank, step], 1.0 if status.mempolicy == step else 0.0)


@FAMILIES.add(
    "counter", "placement_restarts", "Restarts of the process by the supervisor.", ("rank",)
)
def _restarts(
    m: CounterMetricFamily,
    placement: Placement,
    processes: Processes,
    restarts: Mapping[str, int],
) -> None:
    for rank, status in _statuses(placement, processes):
        m.add_metric([rank], restarts.get(rank, status.restarts))


@FAMILIES.add(
    "counter",
    "placement_restarts_requested",
    "Of placement_restarts_total, the restarts someone asked for (POST /ranks/N/restart, "
    "a reload that changed the process): the rest followed an exit nobody asked for.",
    ("rank",),
)
def _restarts_requested(
    m: CounterMetricFamily,
    placement: Placement,
    processes: Processes,
    restarts_requested: Mapping[str, int],
) -> None:
    for rank, _ in _statuses(placement, processes):
        m.add_metric([rank], restarts_requested.get(rank, 0))


# -- what the checks observed -------------------------------------------------------------


@FAMILIES.add(
    "gauge",
    "placement_local_memory_ratio",
    "Resident memory on the planned nodes / all resident memory (0..1).",
    ("rank",),
)
def _ratio(m: GaugeMetricFamily, placement: Placement, observed: Observed) -> None:
    for key in process_keys(placement):
        obs = observed.get(key)
        if obs is not None and obs.local_memory_ratio is not None:
            m.add_metric([key_label(key)], obs.local_memory_ratio)


@FAMILIES.add(
    "gauge",
    "placement_local_memory_ratio_threshold",
    "drift.local_memory_threshold: a local memory ratio below it is a memory_locality "
    "finding (alert PlacementLocalMemoryLow compares with it).",
)
def _ratio_threshold(m: GaugeMetricFamily, local_memory_threshold: float | None) -> None:
    if local_memory_threshold is not None:
        m.add_metric([], local_memory_threshold)


@FAMILIES.add(
    "gauge",
    "placement_memory_bytes",
    "Resident memory of the process per NUMA node.",
    ("rank", "node"),
)
def _memory(m: GaugeMetricFamily, placement: Placement, observed: Observed) -> None:
    for key in process_keys(placement):
        obs = observed.get(key)
        if obs is not None:
            for node, size in sorted(obs.memory_bytes_by_node.items()):
                m.add_metric([key_label(key), str(node)], size)


@FAMILIES.add("gauge", "placement_threads", "Threads of the process per role.", ("rank", "role"))
def _threads(m: GaugeMetricFamily, placement: Placement, observed: Observed) -> None:
    for key in process_keys(placement):
        obs = observed.get(key)
        if obs is not None:
            per_role: dict[str, int] = {}
            for t in obs.threads:
                per_role[t.role] = per_role.get(t.role, 0) + 1
            for role, n in sorted(per_role.items()):
                m.add_metric([key_label(key), role], n)


@FAMILIES.add("gauge", "placement_planned_cpus", "CPUs the plan gives each role.", ("rank", "role"))
def _planned(m: GaugeMetricFamily, placement: Placement) -> None:
    for key in process_keys(placement):
        for role, cpus in sorted(placement.slot(key).roles.items()):
            m.add_metric([key_label(key), role], len(cpus))


@FAMILIES.add(
    "gauge",
    "placement_drift_findings",
    "Current differences between the plan and live state, by kind.",
    ("rank", "kind"),
)
def _findings(
    m: GaugeMetricFamily, placement: Placement, drift: Mapping[ProcKey, tuple[Finding, ...]]
) -> None:
    for key in process_keys(placement):
        current: dict[str, int] = dict.fromkeys(DRIFT_KINDS, 0)
        for f in drift.get(key, ()):
            current[f.kind] = current.get(f.kind, 0) + 1
        for kind, n in current.items():
            m.add_metric([key_label(key), kind], n)


# -- what the supervisor did (counters, pre-initialised) -----------------------------------


@FAMILIES.add(
    "counter",
    "placement_bind_failures",
    "Binds the kernel refused, by target (process, thread, memory, irq, cgroup) and reason.",
    ("rank", "target", "reason"),
)
def _bind_failures(
    m: CounterMetricFamily,
    placement: Placement,
    bind_failures: Mapping[tuple[str, str, str], int],
) -> None:
    table: dict[tuple[str, str, str], int] = {}
    for key in process_keys(placement):
        table.update(dict.fromkeys(_bind_failure_labels(key), 0))
    table.update((k, n) for k, n in bind_failures.items() if k[0] != HOST_LABEL)
    for labels, n in sorted(table.items()):
        m.add_metric(list(labels), n)


@FAMILIES.add(
    "counter",
    "placement_host_bind_failures",
    "Binds of the supervisor's own (instance cgroup, IRQ re-plan) the kernel refused; "
    "docs/contracts.md §5 keeps `rank` for ranks and the engine.",
    ("target", "reason"),
)
def _host_bind_failures(
    m: CounterMetricFamily, bind_failures: Mapping[tuple[str, str, str], int]
) -> None:
    table: dict[tuple[str, str], int] = dict.fromkeys(HOST_BIND_FAILURES, 0)
    table.update((k[1:], n) for k, n in bind_failures.items() if k[0] == HOST_LABEL)
    for labels, n in sorted(table.items()):
        m.add_metric(list(labels), n)


def _per_process(
    m: CounterMetricFamily,
    placement: Placement,
    counted: Mapping[tuple[str, str], int],
    known: tuple[str, ...],
) -> None:
    table: dict[tuple[str, str], int] = {}
    for key in process_keys(placement):
        table.update(dict.fromkeys(((key_label(key), v) for v in known), 0))
    table.update(counted)
    for labels, n in sorted(table.items()):
        m.add_metric(list(labels), n)


@FAMILIES.add(
    "counter",
    "placement_drift_events",
    "Drift findings seen by the checks.",
    ("rank", "kind"),
)
def _drift_events(
    m: CounterMetricFamily, placement: Placement, drift_events: Mapping[tuple[str, str], int]
) -> None:
    _per_process(m, placement, drift_events, DRIFT_KINDS)


@FAMILIES.add("counter", "placement_rebinds", "Re-binds applied, by reason.", ("rank", "reason"))
def _rebinds(
    m: CounterMetricFamily, placement: Placement, rebinds: Mapping[tuple[str, str], int]
) -> None:
    _per_process(m, placement, rebinds, REBIND_REASONS)


@FAMILIES.add(
    "counter", "placement_cpuset_changes", "Changes of the supervisor's allowed cpuset seen."
)
def _cpuset_changes(m: CounterMetricFamily, cpuset_changes: int) -> None:
    m.add_metric([], cpuset_changes)


# The config in force, the file on disk and the last reload (supervisor.serve.config_metrics).
register_config_families(FAMILIES)


# -- adoption (contracts §6) ----------------------------------------------------------------


@FAMILIES.add(
    "counter", "placement_adoptions", "Engine-spawned workers adopted by the rank.", ("rank",)
)
def _adoptions(m: CounterMetricFamily, adoptions: Mapping[str, int]) -> None:
    for rank, n in sorted(adoptions.items()):
        m.add_metric([rank], n)


@FAMILIES.add(
    "counter",
    "placement_rank_waiting_warnings",
    "Ranks still waiting long after the engine started while no process matched (a WARNING each).",
    ("rank",),
)
def _waiting_warnings(m: CounterMetricFamily, waiting_warnings: Mapping[str, int]) -> None:
    for rank, n in sorted(waiting_warnings.items()):
        m.add_metric([rank], n)


@FAMILIES.add(
    "counter",
    "placement_unnamed_processes",
    "Processes of the engine's tree the engine's kind expects to be ranks that no rule named.",
)
def _unnamed_processes(m: CounterMetricFamily, unnamed_processes: int) -> None:
    m.add_metric([], unnamed_processes)


@FAMILIES.add(
    "counter",
    "placement_process_read_failures",
    "Tree members skipped for a pass because their /proc files could not be read.",
)
def _process_read_failures(m: CounterMetricFamily, process_read_failures: int) -> None:
    m.add_metric([], process_read_failures)


# -- the API's own connections (supervisor.serve.guard) ----------------------------------


@FAMILIES.add(
    "counter",
    "placement_http_bad_requests",
    "API requests refused before any route: malformed, oversized or too slow, by reason.",
    ("reason",),
)
def _http_bad_requests(m: CounterMetricFamily, http_bad_requests: Mapping[str, int]) -> None:
    table: dict[str, int] = dict.fromkeys(HTTP_BAD_REASONS, 0)
    table.update(http_bad_requests)
    for reason, n in sorted(table.items()):
        m.add_metric([reason], n)


@FAMILIES.add(
    "counter",
    "placement_http_connections_refused",
    "API connections over api.max_connections, answered 503 and closed.",
)
def _http_refused(m: CounterMetricFamily, http_connections_refused: int) -> None:
    m.add_metric([], http_connections_refused)


@FAMILIES.add(
    "counter",
    "placement_http_connections_shed",
    "API connections with no request in progress closed at api.max_connections for a new one.",
)
def _http_shed(m: CounterMetricFamily, http_connections_shed: int) -> None:
    m.add_metric([], http_connections_shed)


# -- the checks ---------------------------------------------------------------------------


# A summary without quantiles: the count and total of all checks.
@FAMILIES.add(
    "summary",
    "placement_check_duration_seconds",
    "Placement checks finished (_count) and the seconds they took (_sum).",
)
def _check_duration(m: SummaryMetricFamily, checks: int, check_seconds_sum: float) -> None:
    m.add_metric([], checks, check_seconds_sum)


@FAMILIES.add(
    "gauge",
    "placement_last_check_timestamp_seconds",
    "Unix time the last placement check finished (0 before the first).",
)
def _last_check(m: GaugeMetricFamily, last_check_at: float) -> None:
    m.add_metric([], last_check_at)


@FAMILIES.add(
    "gauge", "placement_last_check_duration_seconds", "How long the last placement check took."
)
def _last_duration(m: GaugeMetricFamily, last_check_duration_s: float) -> None:
    m.add_metric([], last_check_duration_s)


@FAMILIES.add("gauge", "placement_start_time_seconds", "Unix time the supervisor started.")
def _start_time(m: GaugeMetricFamily, started_at: float) -> None:
    m.add_metric([], started_at)


# -- the supervisor's own process (sampled on a timer: supervisor.serve.usage) -------------


@FAMILIES.add(
    "counter",
    "placement_supervisor_cpu_seconds",
    "CPU time (user + system) the supervisor's own process used.",
)
def _self_cpu(m: CounterMetricFamily, self_usage: SelfUsage | None) -> None:
    if self_usage is not None:
        m.add_metric([], self_usage.cpu_seconds)


@FAMILIES.add(
    "gauge",
    "placement_supervisor_resident_memory_bytes",
    "Resident memory of the supervisor's own process.",
)
def _self_memory(m: GaugeMetricFamily, self_usage: SelfUsage | None) -> None:
    if self_usage is not None:
        m.add_metric([], self_usage.resident_memory_bytes)


def build_collector(store: StateStore) -> SnapshotCollector:
    """A collector of `FAMILIES` over `store.snapshot`."""
    return SnapshotCollector(store, FAMILIES)


def build_registry(
    store: StateStore, collector: SnapshotCollector | None = None
) -> CollectorRegistry:
    """A registry of the daemon's own holding the snapshot collector only."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector if collector is not None else build_collector(store))
    return registry
