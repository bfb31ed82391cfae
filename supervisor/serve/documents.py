"""The JSON documents of the API (docs/contracts.md §4), pure functions of a `Snapshot` (no I/O).

/placement (with `PlacementRenderer`, its per-process reuse), /topology,
/events, /healthz and /readyz, and `not_ready_reasons`, which /readyz,
/placement's `supervisor` object and the `placement_ready` metric share.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any

from supervisor import __version__
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Placement, RankPlacement, Slot
from supervisor.state import Observation, ProcessStatus, Snapshot
from supervisor.topology.model import Topology
from supervisor.topology.render import topology_to_doc


def plain(value: Any) -> Any:
    """A JSON-ready copy of dataclasses, mappings, sets and tuples."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    # Event fields may hold anything a caller passed; never fail a response on it.
    copy = plain(value)
    return copy if copy is not value else str(value)


def dumps(doc: Any) -> bytes:
    """Compact JSON bytes, as every API body is sent."""
    return json.dumps(doc, separators=(",", ":"), default=_json_default).encode()


# -- readiness ---------------------------------------------------------------------


def process_keys(placement: Placement) -> tuple[ProcKey, ...]:
    """ "engine" first (when planned), then ranks in order: `Snapshot.keys()` from a plan."""
    keys: list[ProcKey] = ["engine"] if placement.engine is not None else []
    keys.extend(r.rank for r in placement.ranks)
    return tuple(keys)


def readiness(
    placement: Placement,
    processes: Mapping[ProcKey, ProcessStatus],
    stopping: bool,
    now: float | None = None,
) -> list[str]:
    """Why the daemon is not ready ([] when it is), from the three things that decide it.

    Stricter than `Snapshot.ready` alone: a planned process that has no status
    yet is not ready either. The metric `placement_ready` calls this with its
    declared inputs; everything else calls `not_ready_reasons(snap)`. With `now`,
    a loading engine's reason says how long it has waited, of how long, and what
    its probe's last attempt found.
    """
    if stopping:
        return ["the supervisor is stopping"]
    reasons: list[str] = []
    for key in process_keys(placement):
        status = processes.get(key)
        if status is None:
            reasons.append(f"{key_label(key)}: not started yet")
        elif status.state != "running" and status.loading is not None and now is not None:
            reasons.append(f"{key_label(key)}: {status.loading.summary(now)}")
        elif status.state != "running":
            reasons.append(f"{key_label(key)}: {status.state}")
        elif not status.bound:
            reasons.append(f"{key_label(key)}: running but not bound as planned")
    # `Snapshot.ready`'s rule, over the same two fields: it also covers a
    # status the plan no longer names (after a re-plan).
    if not reasons and not all(p.state == "running" and p.bound for p in processes.values()):
        reasons.append("a supervised process is not running and bound")
    return reasons


def not_ready_reasons(snap: Snapshot, now: float | None = None) -> list[str]:
    """What /readyz and placement_ready say: [] when every process runs bound."""
    return readiness(snap.placement, snap.processes, snap.stopping, now)


def healthz_doc(
    snap: Snapshot, now: float, stale_after_s: float, up_since: float
) -> dict[str, Any]:
    """GET /healthz: `status` 503 when no check finished for `stale_after_s`.

    The age counts from the last check, else from the daemon's start
    (`snap.started_at`, else `up_since`: when the server started listening).
    """
    counters = snap.counters
    since = counters.last_check_at or snap.started_at or up_since
    age_s = max(0.0, now - since)
    doc: dict[str, Any] = {
        "status": 200,
        "checks": counters.checks,
        "last_check_at": counters.last_check_at or None,
        "last_check_age_s": round(age_s, 3),
        "stale_after_s": stale_after_s,
    }
    if age_s > stale_after_s:
        doc["status"] = 503
        doc["error"] = (
            f"no placement check finished for {age_s:.1f} s"
            if counters.checks
            else f"no placement check finished yet, {age_s:.1f} s after start"
        ) + f" (limit {stale_after_s:g} s)"
    return doc


def readyz_doc(snap: Snapshot, now: float | None = None) -> dict[str, Any]:
    """GET /readyz: `status` 503 with the reasons while not ready, and each process's
    state (a loading engine's with its elapsed time, timeout and last probe result)."""
    now = time.time() if now is None else now
    reasons = not_ready_reasons(snap, now)
    processes = [state_doc(snap, key, now) for key in process_keys(snap.placement)]
    if reasons:
        return {
            "status": 503,
            "error": "not ready: " + "; ".join(reasons),
            "reasons": reasons,
            "processes": processes,
        }
    return {"status": 200, "ready": True, "processes": processes}


def down_since(snap: Snapshot, status: ProcessStatus) -> float | None:
    """When `status` left running (or first got another state); the daemon's start for
    a status published before the store kept it (a worker waiting from the start)."""
    if status.state == "running":
        return None
    return status.down_since or snap.started_at or None


def state_doc(snap: Snapshot, key: ProcKey, now: float) -> dict[str, Any]:
    """One process's state for /readyz: {"process", "state", "down_s", "loading"}
    (`down_s`: seconds since it left running, or since its first start; null while running)."""
    status = snap.processes.get(key)
    loading = None if status is None or status.loading is None else status.loading
    since = None if status is None else down_since(snap, status)
    return {
        "process": key_label(key),
        "state": "not started" if status is None else status.state,
        "down_s": None if since is None else round(max(0.0, now - since), 1),
        "loading": None if loading is None else loading.to_doc(now),
    }


# -- /placement ----------------------------------------------------------------------


def observation_doc(obs: Observation | None) -> dict[str, Any]:
    """The `observed` object of a process (empty lists until the first check)."""
    obs = obs or Observation()
    return {
        # A tree member's threads are listed with its owner's, with their "pid".
        "threads": [
            {"tid": t.tid, "name": t.name, "role": t.role, "cpus": list(t.cpus)}
            if t.pid is None
            else {"tid": t.tid, "name": t.name, "role": t.role, "cpus": list(t.cpus), "pid": t.pid}
            for t in obs.threads
        ],
        # JSON object keys are strings: node 1 is "1".
        "memory_bytes_by_node": {str(n): b for n, b in sorted(obs.memory_bytes_by_node.items())},
        "local_memory_ratio": obs.local_memory_ratio,
        "irqs": [
            {"irq": i.irq, "cpus": list(i.cpus), "planned": list(i.planned)} for i in obs.irqs
        ],
        "observed_at": obs.observed_at or None,
        # Its own cgroup as found: a dir someone removed, a cpuset someone rewrote.
        "cgroup": None if obs.cgroup is None else obs.cgroup.to_doc(),
    }


def not_bound(snap: Snapshot, key: ProcKey, status: ProcessStatus) -> list[dict[str, Any]]:
    """What of `key`'s plan is not bound, and why: `"allowed": false` where the host
    denies it (a capability probed at start), which readiness does not wait for."""
    if status.pid is None:
        return []
    out: list[dict[str, Any]] = []
    if not status.cpus_bound:
        out.append({"target": "cpus", "reason": "the kernel read back other CPUs", "allowed": True})
    # "local" is planned (an engine that spawns the workers), never a step down.
    if status.mempolicy is not None and status.mempolicy not in ("bind", "local"):
        cap = snap.capabilities.get("mempolicy")
        reason = status.mempolicy_reason or f"mempolicy {status.mempolicy}"
        if cap is not None and not cap.available:
            out.append({"target": "memory", "reason": cap.reason or reason, "allowed": False})
        else:
            out.append({"target": "memory", "reason": reason, "allowed": True})
    cgroup = snap.capabilities.get("cgroup")
    if cgroup is not None and cgroup.missing:
        out.append({"target": "cgroup", "reason": cgroup.reason, "allowed": False})
    irq = snap.capabilities.get("irq")
    if irq is not None and irq.missing and _has_irqs(snap.placement, key):
        out.append({"target": "irqs", "reason": irq.reason, "allowed": False})
    return out


def _has_irqs(placement: Placement, key: ProcKey) -> bool:
    return any(r.rank == key and r.irqs for r in placement.ranks)


def process_doc(snap: Snapshot, key: ProcKey, now: float | None = None) -> dict[str, Any]:
    """What /placement adds to the plan entry of one process."""
    status = snap.processes.get(key) or ProcessStatus(key)
    loading = status.loading
    return {
        "pid": status.pid,
        "state": status.state,
        "down_since": down_since(snap, status),  # unix time it left running; null: runs
        # While the engine's probe waits: the probe, elapsed_s of timeout_s, its last result.
        "loading": None if loading is None else loading.to_doc(time.time() if now is None else now),
        "bound": status.bound,
        "cpus_bound": status.cpus_bound,
        "not_bound": not_bound(snap, key, status),
        "restarts": status.restarts,
        "exit_code": status.exit_code,
        "backoff": {"seconds": status.backoff_s, "next_start_at": status.next_start_at},
        "mempolicy": {"step": status.mempolicy, "reason": status.mempolicy_reason},
        "cgroup": status.cgroup,
        "adopted": status.adopted,
        "ppid": status.ppid,
        "children": [m.to_doc() for m in snap.trees.get(key, ())],
        "observed": observation_doc(snap.observed.get(key)),
        "drift": [f.to_doc() for f in snap.drift.get(key, ())],
    }


def supervisor_doc(snap: Snapshot, now: float | None = None) -> dict[str, Any]:
    """The `supervisor` object of /placement: the daemon itself."""
    reasons = not_ready_reasons(snap, time.time() if now is None else now)
    return {
        "version": __version__,
        "accelerator": snap.accelerator_kind,
        "config": snap.config_path,
        "config_hash": snap.config_hash,
        "config_reloads": dict(snap.counters.config_reloads),
        "started_at": snap.started_at,
        "pid": snap.pid,
        "stopping": snap.stopping,
        "ready": not reasons,
        "not_ready": reasons,
        "last_check_at": snap.counters.last_check_at or None,
        "checks": snap.counters.checks,
        "cpuset_changes": snap.counters.cpuset_changes,
        "capabilities": {name: cap.to_doc() for name, cap in snap.capabilities_in_force.items()},
        # AutoNUMA (docs/operations.md): moves the pages of unbound processes.
        "numa_balancing": snap.topology.numa_balancing,
    }


def config_doc(snap: Snapshot) -> dict[str, Any]:
    """The `config` object of /placement: the file's hash in force and on disk now,
    and how the last reload ended (kept until the next)."""
    last = snap.last_reload
    return {
        "path": snap.config_path,
        "in_force": snap.config_hash,
        "on_disk": snap.config_on_disk_hash,
        "last_reload": None if last is None else last.to_doc(),
    }


def placement_doc(snap: Snapshot) -> dict[str, Any]:
    """GET /placement: the plan document (docs/contracts.md §3) with live state per process."""
    doc = snap.placement.to_doc()
    if doc["engine"] is not None:
        doc["engine"].update(process_doc(snap, "engine"))
    for entry in doc["ranks"]:
        entry.update(process_doc(snap, entry["rank"]))
    doc["supervisor"] = supervisor_doc(snap)
    doc["config"] = config_doc(snap)
    return doc


class PlacementRenderer:
    """Renders GET /placement as `dumps(placement_doc(snap))` would, reusing each
    process's JSON while its plan entry, status, observation and findings are
    the same objects.

    Most snapshots change one thing (a counter, an event, one rank's state); a
    16 x 100-thread body is 130 KiB, and rendering all of it on the event loop
    for every new snapshot stalled every request in flight.
    """

    def __init__(self) -> None:
        self._parts: dict[ProcKey, tuple[tuple[object, ...], bytes]] = {}
        self._frame: tuple[object, bytes, bytes] | None = None  # placement, head, tail
        self._last: tuple[Snapshot, bytes] | None = None

    def _process(
        self, snap: Snapshot, key: ProcKey, planned: Slot | RankPlacement, now: float
    ) -> bytes:
        status = snap.processes.get(key)
        if status is not None and status.loading is not None:
            # Its elapsed time moves with the clock, not with the snapshot: never reused.
            doc = planned.to_doc()
            doc.update(process_doc(snap, key, now))
            return dumps(doc)
        identity = (
            planned,
            snap.processes.get(key),
            snap.observed.get(key),
            snap.drift.get(key),
            snap.trees.get(key),
        )
        hit = self._parts.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], identity, strict=True)):
            return hit[1]
        doc = planned.to_doc()
        doc.update(process_doc(snap, key, now))
        body = dumps(doc)
        self._parts[key] = (identity, body)  # holding the objects keeps `is` sound
        return body

    def _head_and_tail(self, placement: Placement) -> tuple[bytes, bytes]:
        """The plan document's own keys around "engine" and "ranks", from
        Placement.to_doc() itself (once per placement: it changes on a re-plan)."""
        if self._frame is None or self._frame[0] is not placement:
            doc = placement.to_doc()
            keys = list(doc)
            at = keys.index("engine")
            assert keys[at : at + 2] == ["engine", "ranks"], keys
            head = dumps({k: doc[k] for k in keys[:at]})[1:-1]
            tail = dumps({k: doc[k] for k in keys[at + 2 :]})[1:-1]
            # `{head,"engine":..,"ranks":[..],tail,"supervisor":..}`
            self._frame = (placement, b"{" + head + b"," * bool(head), b"," * bool(tail) + tail)
        return self._frame[1], self._frame[2]

    def render(self, snap: Snapshot) -> bytes:
        """The body for `snap`; the same bytes object again while the snapshot is the same."""
        last = self._last
        loading = any(p.loading is not None for p in snap.processes.values())
        if last is not None and last[0] is snap and not loading:
            return last[1]
        now = time.time()
        placement = snap.placement
        engine = b"null"
        if placement.engine is not None:
            engine = self._process(snap, "engine", placement.engine, now)
        ranks = [self._process(snap, r.rank, r, now) for r in placement.ranks]
        head, tail = self._head_and_tail(placement)
        body = b"".join(
            (
                head,
                b'"engine":',
                engine,
                b',"ranks":[',
                b",".join(ranks),
                b"]",
                tail,
                b',"supervisor":',
                dumps(supervisor_doc(snap, now)),
                b',"config":',
                dumps(config_doc(snap)),
                b"}",
            )
        )
        self._last = (snap, body)  # holding the snapshot keeps `is` sound
        return body


# -- /topology and /events ----------------------------------------------------------


def topology_doc(topo: Topology) -> dict[str, Any]:
    """GET /topology: the `topology --json` document."""
    return topology_to_doc(topo)


def events_doc(snap: Snapshot, since: int | None, limit: int) -> dict[str, Any]:
    """GET /events: with `since`, the oldest `limit` events after it; else the newest.

    `latest_seq` is the number to pass as the next `since`; a `since` above it
    means the daemon restarted (sequence numbers start again at 1).
    """
    events = snap.events
    newer = events if since is None else tuple(e for e in events if e.seq > since)
    chosen = newer[-limit:] if since is None else newer[:limit]
    latest = events[-1].seq if events else 0
    return {
        "events": [e.to_doc() for e in chosen],
        "latest_seq": latest,
        "oldest_seq": events[0].seq if events else 0,
        "next_since": chosen[-1].seq if chosen else (latest if since is None else since),
        "started_at": snap.started_at,
    }
