"""The daemon's state: one immutable `Snapshot`, written by one writer (no I/O).

The daemon's loop owns a `StateStore`, changes it only from the event loop,
and publishes a new frozen `Snapshot` after each change. The API handlers, the
metrics collector and `status` read `store.snapshot` and nothing else, so they
never touch /proc and never see a half-applied change.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal, get_args

from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Placement, Slot
from supervisor.procfs.identity import ProcessId, ThreadId
from supervisor.topology.accelerators import CPU
from supervisor.topology.model import Topology

ProcessState = Literal["starting", "running", "backoff", "failed", "stopped", "waiting", "stopping"]
"""`stopping`: sent TERM (a restart, a reload that changed the process, the
daemon's stop), not exited yet: not ready, whatever it still answers."""
# "local": MPOL_LOCAL, an engine whose children are workers (docs/engines.md):
# its pages follow its CPUs, and a child it spawns inherits no node of its own.
MemPolicyStep = Literal["bind", "local", "preferred", "none"]

# -- the vocabulary: every event kind and metric label value, in one place -----------

DriftKind = Literal[
    "thread_affinity",
    "memory_locality",
    "irq_affinity",
    "cpuset_changed",
    "process_gone",
    "self_rebind",
    "cgroup",
    "conflict",
]
BindTarget = Literal["process", "thread", "memory", "irq", "cgroup"]
BindReason = Literal["gone", "denied", "invalid", "managed", "error"]
"""`errors.KernelError.reason`: why a bind failed ("managed" happens on IRQs only)."""
RebindReason = Literal[
    "api",
    "thread_affinity",
    "thread_role",
    "memory_locality",
    "irq_affinity",
    "cpuset_changed",
    "cgroup",
]
"""Why something was re-bound: the drift kind corrected, a new thread put in its
role, a new plan after a cpuset change, or POST /rebind."""
EventKind = Literal[
    "spawn",
    "spawn_failed",
    "exit",
    "state",
    "restart",
    "restart_requested",
    "not_started",
    "ready",
    "ready_failed",
    "stopping",
    "error",
    "bind_failed",
    "drift",
    "rebind",
    "migrate",
    "cpuset",
    "plan",
    "plan_failed",
    "irq",
    "irq_moved",
    "irq_restored",
    "irqbalance",
    "adopt",
    "reload",
    "rank_conflict",
    "rank_waiting",
    "attached",
    "detached",
]
DRIFT_KINDS: tuple[DriftKind, ...] = get_args(DriftKind)
BIND_TARGETS: tuple[BindTarget, ...] = get_args(BindTarget)
BIND_REASONS: tuple[BindReason, ...] = get_args(BindReason)
REBIND_REASONS: tuple[RebindReason, ...] = get_args(RebindReason)
EVENT_KINDS: tuple[EventKind, ...] = get_args(EventKind)

EVENTS_KEPT = 1000
# The counter label of failures that belong to no process (the instance
# cgroup, an IRQ re-plan); metrics export them apart from `rank` ones.
HOST_LABEL = "supervisor"
# Why the API answered a request 4xx before any route saw it (supervisor.serve.guard):
# a header line or the header block over its limit (431), a request line or header
# the parser refused (400), headers or a body slower than api.header_timeout_s /
# api.body_timeout_s (closed; 408 for the body).
HttpBadReason = Literal["headers_too_large", "malformed", "header_timeout", "body_timeout"]
# How a config reload (SIGHUP) ended: put in force, the file refused as invalid
# (or not plannable here), or valid but needing a restart (supervisor.daemon.reload).
ReloadResult = Literal["ok", "invalid", "refused"]
RELOAD_RESULTS: tuple[ReloadResult, ...] = get_args(ReloadResult)
HTTP_BAD_REASONS: tuple[HttpBadReason, ...] = get_args(HttpBadReason)
# What the host lets the supervisor bind, probed once at start (supervisor.bind.capability):
# a memory policy (seccomp may fail set_mempolicy/mbind with EPERM), per-process
# cgroups (a writable delegated subtree), IRQ affinity (a writable /proc/irq).
CapabilityName = Literal["mempolicy", "cgroup", "irq"]
CAPABILITY_NAMES: tuple[CapabilityName, ...] = get_args(CapabilityName)


@dataclass(frozen=True, slots=True)
class Capability:
    """One kind of binding and whether this host allows it (probed once at start).

    `wanted`: the config asks for it (cgroup = "auto", irq.enabled); what is
    not wanted is never missing. `Snapshot.capabilities_in_force` narrows irq's
    to the plan in force: wanted only while the plan has IRQs to bind.
    Readiness is "bound as far as allowed": a capability the host denies shows
    here, in /placement and in the metric `placement_capability`, never in /readyz.
    """

    name: CapabilityName
    available: bool
    wanted: bool = True
    reason: str | None = None  # why not, when not available

    @property
    def missing(self) -> bool:
        return self.wanted and not self.available

    def to_doc(self) -> dict[str, Any]:
        return {"available": self.available, "wanted": self.wanted, "reason": self.reason}


def capabilities_in_force(
    capabilities: Mapping[CapabilityName, Capability], placement: Placement
) -> Mapping[CapabilityName, Capability]:
    """`capabilities` as `placement` wants them (pure): IRQ binding is wanted only
    while the plan has IRQs to bind, whatever [irq] enabled says."""
    irq = capabilities.get("irq")
    if irq is None or not irq.wanted or placement.has_irqs:
        return capabilities
    return {**capabilities, "irq": replace(irq, wanted=False)}


@dataclass(frozen=True, slots=True)
class ReloadVerdict:
    """How the last config reload ended (supervisor.daemon.reload): what STATUS=,
    /placement's `config.last_reload` and the reload metrics keep until the next."""

    at: float  # unix time it ended
    result: ReloadResult
    error: str | None = None  # why it was refused or invalid ("file: key: why")

    def to_doc(self) -> dict[str, Any]:
        return {"at": self.at, "result": self.result, "error": self.error}

    def summary(self) -> str:
        """ "reload applied", "reload refused: why", "reload invalid: file: key: why"."""
        if self.result == "ok":
            return "reload applied"
        return f"reload {self.result}: {self.error}"


@dataclass(frozen=True, slots=True)
class Loading:
    """The engine while its `[ready]` probe waits: what is probed, since when, for how
    long at most, and the last attempt's result (None before the first)."""

    probe: str  # "tcp 127.0.0.1:8000" (supervisor.run.probe.describe_probe)
    since: float  # unix time the probe started
    timeout_s: float
    last: str | None = None

    def elapsed_s(self, now: float) -> float:
        return max(0.0, now - self.since)

    def to_doc(self, now: float) -> dict[str, Any]:
        return {
            "probe": self.probe,
            "since": self.since,
            "elapsed_s": round(self.elapsed_s(now), 1),
            "timeout_s": self.timeout_s,
            "last": self.last,
        }

    def summary(self, now: float) -> str:
        """ "loading 12s of 600s, tcp 127.0.0.1:8000: connection refused"."""
        last = self.last or "not checked yet"
        return f"loading {self.elapsed_s(now):.0f}s of {self.timeout_s:g}s, {self.probe}: {last}"


@dataclass(frozen=True, slots=True)
class ProcessStatus:
    """One supervised process (the engine or a rank's worker)."""

    key: ProcKey
    state: ProcessState = "starting"
    pid: int | None = None
    # Who runs at `pid` (its start time: stat field 22); None while unknown (no
    # process yet, or its stat not read yet). Not cleared with `pid`: read with it.
    id: ProcessId | None = None
    restarts: int = 0
    backoff_s: float = 0.0  # the delay before the next start, when in backoff
    next_start_at: float | None = None  # unix time of the next start, when in backoff
    exit_code: int | None = None  # last exit status (negative: killed by that signal)
    mempolicy: MemPolicyStep | None = None  # what the shim got from the kernel
    mempolicy_reason: str | None = None
    cgroup: str | None = None  # the process's own cgroup, when it has one
    bound: bool = False  # every bind of the plan the host allows applied and read back
    cpus_bound: bool = False  # the kernel read back exactly the planned CPUs
    adopted: bool = False  # spawned by the engine and adopted (docs/contracts.md §6)
    ppid: int | None = None  # an adopted worker's parent
    # Unix time it stopped running, or first started when it never ran; None
    # while it runs (and before its first status: the daemon's start then).
    # Kept across starting/backoff/starting, so a load that keeps failing ages.
    down_since: float | None = None
    loading: Loading | None = None  # while the engine's readiness probe waits


Supervised = tuple[ProcKey, ProcessStatus, Slot]
"""A planned process as its runner has it: key, status, slot."""


@dataclass(frozen=True, slots=True)
class TreeMember:
    """A process of a supervised process's tree other than itself (docs/contracts.md §6)."""

    id: ProcessId  # the check loop scans it while its pid is this process
    ppid: int
    cmdline: str
    cpus: tuple[int, ...]

    @property
    def pid(self) -> int:
        return self.id.pid

    def to_doc(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "ppid": self.ppid,
            "cmdline": self.cmdline,
            "cpus": list(self.cpus),
        }


@dataclass(frozen=True, slots=True)
class ThreadObservation:
    tid: int
    name: str
    role: str
    cpus: tuple[int, ...]
    # Who the thread is (tid + start time): a write checks the tid still names it.
    # None where its start time was not read (a one-shot read): the Tgid alone.
    id: ThreadId | None = None
    pid: int | None = None  # the tree member it runs in; None: the supervised process itself


@dataclass(frozen=True, slots=True)
class IrqObservation:
    irq: int
    cpus: tuple[int, ...]  # effective affinity as the kernel reports it
    planned: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CgroupObservation:
    """A process's own cgroup as the check found it: what someone else may have changed."""

    missing: tuple[str, ...] = ()  # its dirs (absolute) that are gone
    cpus: tuple[int, ...] | None = None  # its cpuset.cpus as written; None: none (v1) or gone
    mems: tuple[int, ...] | None = None  # its cpuset.mems as written
    outside: bool = False  # the process is not in its cgroup (in every hierarchy)

    def to_doc(self) -> dict[str, Any]:
        return {
            "missing": list(self.missing),
            "cpus": None if self.cpus is None else list(self.cpus),
            "mems": None if self.mems is None else list(self.mems),
            "outside": self.outside,
        }


@dataclass(frozen=True, slots=True)
class Observation:
    """Live state of one process, as the last check found it."""

    threads: tuple[ThreadObservation, ...] = ()
    memory_bytes_by_node: Mapping[int, int] = field(default_factory=dict)
    local_memory_ratio: float | None = None
    irqs: tuple[IrqObservation, ...] = ()
    observed_at: float = 0.0  # unix time
    cgroup: CgroupObservation | None = None  # its own cgroup; None: it has none


@dataclass(frozen=True, slots=True)
class Finding:
    """One difference between the plan and live state."""

    kind: DriftKind
    target: str  # "tid 4242", "irq 41", "memory", "cpuset"
    expected: str
    actual: str
    action: Literal["observe", "enforce", "failed"] = "observe"

    def to_doc(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "expected": self.expected,
            "actual": self.actual,
            "action": self.action,
        }


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened: a spawn, exit, bind, drift finding, re-bind..."""

    seq: int
    ts: float  # unix time
    kind: EventKind | ProcessState  # a runner's held state is its own event kind
    key: ProcKey | None
    message: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def to_doc(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "ts": self.ts,
            "kind": self.kind,
            "rank": None if self.key is None else key_label(self.key),
            "message": self.message,
            "fields": dict(self.fields),
        }


@dataclass(frozen=True, slots=True)
class Counters:
    """Monotonic counters behind the `_total` metrics of docs/contracts.md §5."""

    bind_failures: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    drift_events: Mapping[tuple[str, str], int] = field(default_factory=dict)  # rank, kind
    rebinds: Mapping[tuple[str, str], int] = field(default_factory=dict)  # rank, reason
    restarts: Mapping[str, int] = field(default_factory=dict)  # rank
    # Of those, the restarts someone asked for (POST /ranks/N/restart, a reload
    # that changed the process's command or environment): not a crash loop.
    restarts_requested: Mapping[str, int] = field(default_factory=dict)  # rank
    adoptions: Mapping[str, int] = field(default_factory=dict)  # rank
    # Ranks still waiting long after the engine started with nothing matched (a WARNING each).
    waiting_warnings: Mapping[str, int] = field(default_factory=dict)  # rank
    unnamed_processes: int = 0  # engine-tree processes the kind expects as ranks, left unnamed
    process_read_failures: int = 0  # tree members whose /proc files could not be read
    cpuset_changes: int = 0
    # The API's malformed or too slow requests (supervisor.serve.guard), by reason.
    http_bad_requests: Mapping[str, int] = field(default_factory=dict)
    http_connections_refused: int = 0  # over api.max_connections: answered 503, closed
    http_connections_shed: int = 0  # closed at the cap, no request in progress, for a new one
    config_reloads: Mapping[str, int] = field(default_factory=dict)  # result
    checks: int = 0
    check_seconds_sum: float = 0.0
    last_check_duration_s: float = 0.0
    last_check_at: float = 0.0  # unix time of the last finished check


@dataclass(frozen=True, slots=True)
class SelfUsage:
    """The supervisor's own process, sampled on a timer (supervisor.serve.usage), not at scrape."""

    cpu_seconds: float  # user + system, since the process started
    resident_memory_bytes: int
    sampled_at: float  # unix time


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the API, metrics and status show, frozen at one instant."""

    placement: Placement
    topology: Topology
    processes: Mapping[ProcKey, ProcessStatus]
    observed: Mapping[ProcKey, Observation] = field(default_factory=dict)
    drift: Mapping[ProcKey, tuple[Finding, ...]] = field(default_factory=dict)
    trees: Mapping[ProcKey, tuple[TreeMember, ...]] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    events: tuple[Event, ...] = ()
    started_at: float = 0.0
    pid: int | None = None  # the daemon's own (what `placement-supervisor reload` signals)
    stopping: bool = False
    accelerator_kind: str = CPU.name
    config_path: str | None = None
    config_hash: str | None = None  # sha256 of the config file in force (hex)
    # sha256 of the config file as it is on disk now (read at each reload and every
    # CONFIG_WATCH_S, supervisor.daemon.reload); None while it cannot be read.
    config_on_disk_hash: str | None = None
    last_reload: ReloadVerdict | None = None  # None until the first reload
    # drift.local_memory_threshold, exported for the alert that compares the
    # ratio with it; None where no config made the snapshot (tests).
    local_memory_threshold: float | None = None
    # [ready] timeout_s: how long the engine may load before its start counts
    # as failed (alert PlacementRankNotUp waits that long); None: no probe.
    ready_timeout_s: float | None = None
    self_usage: SelfUsage | None = None  # None until the first sample
    # What the host allows binding (supervisor.bind.capability), by name; empty
    # where nothing was probed (tests, a Daemon embedded without run_command).
    capabilities: Mapping[CapabilityName, Capability] = field(default_factory=dict)

    @property
    def capabilities_in_force(self) -> Mapping[CapabilityName, Capability]:
        """`capabilities` as the plan in force wants them (what /placement and the
        metrics show): IRQ binding is wanted only while the plan has IRQs to bind,
        so a host that denies it (a container's read-only /proc/irq) misses
        nothing when no device of the plan has an IRQ."""
        return capabilities_in_force(self.capabilities, self.placement)

    def allows(self, name: CapabilityName) -> bool:
        """False only when the probe found the host denies `name`."""
        cap = self.capabilities.get(name)
        return cap is None or cap.available

    @property
    def ready(self) -> bool:
        """Every process running and bound as far as the host allows (what /readyz answers)."""
        return not self.stopping and all(
            p.state == "running" and p.bound for p in self.processes.values()
        )

    def keys(self) -> tuple[ProcKey, ...]:
        """ "engine" first (when planned), then ranks in order."""
        keys: list[ProcKey] = ["engine"] if self.placement.engine is not None else []
        keys.extend(r.rank for r in self.placement.ranks)
        return tuple(keys)


class StateStore:
    """The single writer. Call its methods from the event loop only."""

    def __init__(self, initial: Snapshot) -> None:
        self._snapshot = initial
        self._events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self._seq = 0

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def update(self, **changes: Any) -> Snapshot:
        """Publish a new snapshot with `changes` (dataclass field names)."""
        self._snapshot = replace(self._snapshot, **changes)
        return self._snapshot

    def set_process(self, status: ProcessStatus) -> None:
        """Publish `status`, with `down_since` kept: set when it leaves `running`
        (or first gets a state that is not), cleared when it runs."""
        if status.state == "running":
            if status.down_since is not None:
                status = replace(status, down_since=None)
        elif status.down_since is None:
            status = replace(status, down_since=time.time())
        procs = dict(self._snapshot.processes)
        procs[status.key] = status
        self.update(processes=MappingProxyType(procs))

    def set_observation(
        self, key: ProcKey, observation: Observation, findings: tuple[Finding, ...]
    ) -> None:
        self.set_observations({key: (observation, findings)})

    def set_observations(
        self, results: Mapping[ProcKey, tuple[Observation, tuple[Finding, ...]]]
    ) -> None:
        """Publish one check pass's observations and findings as one snapshot.

        One snapshot per pass rather than one per process: the API caches its
        rendered bodies per snapshot, and a 16-rank pass would otherwise
        invalidate them 17 times a second."""
        if not results:
            return
        observed = dict(self._snapshot.observed)
        drift = dict(self._snapshot.drift)
        for key, (observation, findings) in results.items():
            observed[key] = observation
            drift[key] = findings
        self.update(observed=MappingProxyType(observed), drift=MappingProxyType(drift))

    def finish_check(self, duration_s: float) -> None:
        """Count one finished check pass that took `duration_s`."""
        c = self._snapshot.counters
        self.update(
            counters=replace(
                c,
                checks=c.checks + 1,
                check_seconds_sum=c.check_seconds_sum + duration_s,
                last_check_duration_s=duration_s,
                last_check_at=time.time(),
            )
        )

    def emit(
        self, kind: EventKind | ProcessState, key: ProcKey | None, message: str, **fields: Any
    ) -> Event:
        self._seq += 1
        event = Event(self._seq, time.time(), kind, key, message, MappingProxyType(fields))
        self._events.append(event)
        self.update(events=tuple(self._events))
        return event

    def count(
        self,
        counter: Literal[
            "bind_failures",
            "drift_events",
            "rebinds",
            "restarts",
            "restarts_requested",
            "adoptions",
            "http_bad_requests",
            "config_reloads",
            "waiting_warnings",
        ],
        label: tuple[str, ...] | str,
        n: int = 1,
    ) -> None:
        """Add `n` to a labelled counter of `Counters` ("bind_failures", ...)."""
        counters = self._snapshot.counters
        table: dict[Any, int] = dict(getattr(counters, counter))
        table[label] = table.get(label, 0) + n
        changes: dict[str, Any] = {counter: MappingProxyType(table)}
        self.update(counters=replace(counters, **changes))
