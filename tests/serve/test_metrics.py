"""Metrics from the snapshot collector: names and values (docs/contracts.md §5), pre-initialised
counters, no I/O at scrape time, and `promtool check metrics` on the exposition."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import psutil
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from supervisor.config import parse_config
from supervisor.daemon.root import Daemon, prepare
from supervisor.events import Recorder
from supervisor.hostfs import HostFS
from supervisor.serve.documents import placement_doc
from supervisor.serve.exposition import FORMATS_KEPT, INPUTS, FamilyTable, SnapshotCollector
from supervisor.serve.metrics import (
    BIND_REASONS,
    BIND_TARGETS,
    DRIFT_KINDS,
    FAMILIES,
    HOST_BIND_FAILURES,
    REBIND_REASONS,
    build_collector,
    build_registry,
)
from supervisor.serve.usage import read_self_usage, self_usage_loop
from supervisor.state import HOST_LABEL, ProcessStatus, SelfUsage, Snapshot, StateStore
from tests.support.api_fixture import Scenario, realistic_snapshot

REPO = Path(__file__).resolve().parents[2]


def registry_for(snap: Snapshot) -> Any:
    return build_registry(StateStore(snap))


def test_required_metrics_have_the_snapshot_values() -> None:
    snap = realistic_snapshot()
    reg = registry_for(snap)
    v = reg.get_sample_value
    for key in snap.keys():  # noqa: SIM118 (a Snapshot method, not a dict)
        rank = str(key)
        obs = snap.observed[key]
        assert v("placement_up", {"rank": rank}) == 1.0
        assert v("placement_local_memory_ratio", {"rank": rank}) == pytest.approx(
            obs.local_memory_ratio
        )
        for node, size in obs.memory_bytes_by_node.items():
            assert v("placement_memory_bytes", {"rank": rank, "node": str(node)}) == size
        assert v("placement_process_state", {"rank": rank, "state": "running"}) == 1.0
        assert v("placement_process_state", {"rank": rank, "state": "failed"}) == 0.0
        assert v("placement_mempolicy", {"rank": rank, "policy": "bind"}) == 1.0
        assert v("placement_mempolicy", {"rank": rank, "policy": "preferred"}) == 0.0
        assert v("placement_backoff_seconds", {"rank": rank}) == 0.0
    assert v("placement_restarts_total", {"rank": "2"}) == 1.0
    assert v("placement_restarts_total", {"rank": "engine"}) == 0.0
    assert v("placement_bind_failures_total", {"rank": "3", "target": "irq", "reason": "managed"})
    assert v("placement_drift_events_total", {"rank": "1", "kind": "thread_affinity"}) == 2.0
    assert v("placement_drift_findings", {"rank": "1", "kind": "thread_affinity"}) == 1.0
    assert v("placement_rebinds_total", {"rank": "1", "reason": "thread_affinity"}) == 2.0
    assert v("placement_cpuset_changes_total") == 0.0
    assert v("placement_check_duration_seconds_count") == 42.0
    assert v("placement_check_duration_seconds_sum") == pytest.approx(0.42)
    assert v("placement_last_check_duration_seconds") == pytest.approx(0.011)
    assert v("placement_last_check_timestamp_seconds") == snap.counters.last_check_at
    assert v("placement_start_time_seconds") == snap.started_at
    assert v("placement_ready") == 1.0
    assert (
        v(
            "placement_info",
            {"version": "0.1.0", "strategy": "numa-affine", "accelerator": "nvidia"},
        )
        == 1.0
    )
    assert v("placement_threads", {"rank": "0", "role": "main"}) == 3.0
    assert v("placement_planned_cpus", {"rank": "engine", "role": "so_compiler"}) == 4.0


def test_restarts_asked_for_are_counted_apart_from_crash_restarts() -> None:
    """What PlacementRankCrashLooping subtracts: restarts someone asked for (the runner's
    manual restart) count in both counters, a restart after an exit in one."""
    snap = realistic_snapshot(Scenario(drifted_rank=None, restarted_rank=None, failures={}))
    store = StateStore(snap)
    recorder = Recorder(store)
    for _ in range(3):
        recorder.restart_counted(1)  # POST /ranks/1/restart, a reload's restart
    recorder.restart_scheduled(2, "exit code 1", 1.0, 1)  # an exit nobody asked for
    v = registry_for(store.snapshot).get_sample_value
    assert v("placement_restarts_total", {"rank": "1"}) == 3.0
    assert v("placement_restarts_requested_total", {"rank": "1"}) == 3.0
    assert v("placement_restarts_total", {"rank": "2"}) == 1.0
    assert v("placement_restarts_requested_total", {"rank": "2"}) == 0.0


def test_counters_exist_at_zero_for_every_process_and_label() -> None:
    """`increase()` needs a sample before the first failure: every series starts at 0."""
    snap = realistic_snapshot(Scenario(drifted_rank=None, restarted_rank=None, failures={}))
    v = registry_for(snap).get_sample_value
    for key in snap.keys():  # noqa: SIM118 (a Snapshot method, not a dict)
        rank = str(key)
        assert v("placement_restarts_total", {"rank": rank}) == 0.0
        assert v("placement_restarts_requested_total", {"rank": rank}) == 0.0
        for kind in DRIFT_KINDS:
            assert v("placement_drift_events_total", {"rank": rank, "kind": kind}) == 0.0
        for reason in REBIND_REASONS:
            assert v("placement_rebinds_total", {"rank": rank, "reason": reason}) == 0.0
        for target in BIND_TARGETS:
            for reason in BIND_REASONS:
                labels = {"rank": rank, "target": target, "reason": reason}
                expected = None if (key == "engine" and target == "irq") else 0.0
                assert v("placement_bind_failures_total", labels) == expected
    managed = {"rank": "0", "target": "irq", "reason": "managed"}
    assert v("placement_bind_failures_total", managed) == 0.0
    managed["target"] = "thread"
    assert v("placement_bind_failures_total", managed) is None  # EIO is an IRQ's answer only
    for target, reason in HOST_BIND_FAILURES:
        labels = {"target": target, "reason": reason}
        assert v("placement_host_bind_failures_total", labels) == 0.0
    assert {target for target, _ in HOST_BIND_FAILURES} == {"cgroup", "irq"}


def test_states_backoff_and_mempolicy_follow_the_process() -> None:
    snap = realistic_snapshot()
    store = StateStore(snap)
    reg = build_registry(store)
    v = reg.get_sample_value
    store.set_process(replace(snap.processes[1], state="backoff", backoff_s=8.0, pid=None))
    store.set_process(replace(snap.processes[2], state="failed", mempolicy="preferred"))
    store.set_process(replace(snap.processes[3], bound=False))
    assert v("placement_up", {"rank": "1"}) == 0.0
    assert v("placement_backoff_seconds", {"rank": "1"}) == 8.0
    assert v("placement_process_state", {"rank": "1", "state": "backoff"}) == 1.0
    assert v("placement_process_state", {"rank": "1", "state": "running"}) == 0.0
    assert v("placement_process_state", {"rank": "2", "state": "failed"}) == 1.0
    assert v("placement_mempolicy", {"rank": "2", "policy": "preferred"}) == 1.0
    assert v("placement_mempolicy", {"rank": "2", "policy": "bind"}) == 0.0
    assert v("placement_bound", {"rank": "3"}) == 0.0
    assert v("placement_ready") == 0.0
    store.update(stopping=True)
    assert v("placement_ready") == 0.0


def test_unobserved_and_unstarted_processes() -> None:
    snap = realistic_snapshot()
    snap = replace(snap, processes={0: ProcessStatus(0, "running", pid=7)}, observed={})
    v = registry_for(snap).get_sample_value
    assert v("placement_up", {"rank": "0"}) == 1.0
    assert v("placement_up", {"rank": "1"}) == 0.0  # planned, no status yet
    assert v("placement_process_state", {"rank": "1", "state": "starting"}) == 1.0
    assert v("placement_local_memory_ratio", {"rank": "0"}) is None
    assert v("placement_mempolicy", {"rank": "1", "policy": "bind"}) is None
    assert v("placement_ready") == 0.0


def test_registry_is_private() -> None:
    snap = realistic_snapshot()
    store = StateStore(snap)
    a, b = build_registry(store), build_registry(store)  # no duplicate-timeseries error
    assert a is not REGISTRY and b is not REGISTRY
    assert REGISTRY.get_sample_value("placement_up", {"rank": "0"}) is None
    assert a.get_sample_value("placement_up", {"rank": "0"}) == 1.0


# -- no I/O at scrape or render time ---------------------------------------------------

_IO_EVENTS = ("open", "os.listdir", "os.scandir", "socket.", "subprocess.", "os.system")
_watch: list[list[str]] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _watch and event.startswith(_IO_EVENTS):
        _watch[-1].append(f"{event} {args[:1]!r}")


sys.addaudithook(_audit)  # hooks cannot be removed; it records only while _watch is set


@contextmanager
def watching() -> Iterator[list[str]]:
    seen: list[str] = []
    _watch.append(seen)
    try:
        yield seen
    finally:
        _watch.pop()


def test_collect_and_placement_rendering_do_no_io() -> None:
    snap = realistic_snapshot()
    reg = registry_for(snap)
    generate_latest(reg)  # warm up lazy imports, which open files legitimately
    placement_doc(snap)
    with watching() as seen:
        assert b"placement_up" in generate_latest(reg)
        assert generate_openmetrics(reg).endswith(b"# EOF\n")
        assert placement_doc(snap)["ranks"]
        assert seen == []
        # The watch itself works: a real open is seen.
        with open(__file__, "rb"):
            pass
        assert any(e.startswith("open") for e in seen)


# -- exposition formats -----------------------------------------------------------------


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_check_metrics_accepts_the_exposition() -> None:
    body = generate_latest(registry_for(realistic_snapshot()))
    proc = subprocess.run(
        ["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert proc.stdout.strip() == b"" and proc.stderr.strip() == b""


def test_openmetrics_exposition_parses() -> None:
    text = generate_openmetrics(registry_for(realistic_snapshot())).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["placement_bind_failures"].type == "counter"
    assert families["placement_check_duration_seconds"].type == "summary"
    assert families["placement"].type == "info"
    up = {s.labels["rank"]: s.value for s in families["placement_up"].samples}
    assert up == {"engine": 1.0, "0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0}


def test_failures_of_no_process_keep_out_of_the_rank_label() -> None:
    """docs/contracts.md §5: `rank` is a rank number or engine; the supervisor's own
    failures (its instance cgroup, an IRQ re-plan) have a family of their own."""
    store = StateStore(realistic_snapshot())
    store.count("bind_failures", (HOST_LABEL, "cgroup", "error"))
    registry = build_registry(store)
    labels = {"target": "cgroup", "reason": "error"}
    assert registry.get_sample_value("placement_host_bind_failures_total", labels) == 1
    ranks = {
        s.labels["rank"]
        for m in registry.collect()
        if m.name == "placement_bind_failures"
        for s in m.samples
    }
    assert HOST_LABEL not in ranks
    assert ranks == {"engine", *(str(r.rank) for r in store.snapshot.placement.ranks)}


# -- what each family depends on, and the incremental renderer --------------------------


def test_every_family_names_only_snapshot_inputs_and_a_bad_name_fails_at_once() -> None:
    assert len(FAMILIES) >= 20
    for family in FAMILIES:
        assert family.inputs, family.name  # every family shows something of the snapshot
        assert set(family.inputs) <= set(INPUTS), family.name
    table = FamilyTable()
    with pytest.raises(TypeError, match=r"placement_x: _x takes threshold, which is no Snapshot"):

        @table.add("gauge", "placement_x", "A family reading a field that does not exist.")
        def _x(m: GaugeMetricFamily, threshold: float) -> None:
            m.add_metric([], threshold)

    assert len(table) == 0


def _rebuilt(collector: SnapshotCollector, change: Callable[[], object]) -> set[str]:
    before = dict(collector.renderer.built)
    change()
    list(collector.collect())
    return {name for name, n in collector.renderer.built.items() if n != before[name]}


def test_a_change_rebuilds_exactly_the_families_that_read_it() -> None:
    """The dependency set is derived from the families' parameters: changing
    one input rebuilds every family that names it and no other."""
    store = StateStore(realistic_snapshot())
    collector = build_collector(store)
    list(collector.collect())
    snap = store.snapshot
    changes: dict[str, Callable[[], object]] = {
        "processes": lambda: store.set_process(replace(snap.processes[1], state="backoff")),
        "observed": lambda: store.update(observed=MappingProxyType(dict(snap.observed))),
        "drift": lambda: store.update(drift=MappingProxyType(dict(snap.drift))),
        "restarts": lambda: store.count("restarts", "3"),
        "bind_failures": lambda: store.count("bind_failures", ("0", "thread", "gone")),
        "rebinds": lambda: store.count("rebinds", ("0", "api")),
        "stopping": lambda: store.update(stopping=True),
        "started_at": lambda: store.update(started_at=1.0),
        "accelerator_kind": lambda: store.update(accelerator_kind="amd"),
        "self_usage": lambda: store.update(self_usage=SelfUsage(1.5, 1 << 20, 2.0)),
        "local_memory_threshold": lambda: store.update(local_memory_threshold=0.8),
        "placement": lambda: store.update(placement=replace(snap.placement, warnings=("w",))),
    }
    for name, change in changes.items():
        expected = {f.name for f in FAMILIES if name in f.inputs}
        assert expected, name
        assert _rebuilt(collector, change) == expected, name
    # An event alone changes nothing any family reads.
    assert _rebuilt(collector, lambda: store.emit("note", 0, "just an event")) == set()
    # Counters replaced with equal numbers are not a change.
    c = store.snapshot.counters
    equal = replace(c, checks=int(str(c.checks)), check_seconds_sum=float(str(c.check_seconds_sum)))
    assert _rebuilt(collector, lambda: store.update(counters=equal)) == set()


ENCODINGS = [
    choose_encoder(""),
    choose_encoder("application/openmetrics-text; version=1.0.0"),
]


@pytest.mark.parametrize(("encoder", "content_type"), ENCODINGS)
def test_incremental_exposition_is_what_a_full_render_gives(
    encoder: Callable[[Any], bytes], content_type: str
) -> None:
    """Through a run of changes, the body from cached family texts is byte for
    byte what the encoder renders from a fresh registry over the same snapshot."""
    store = StateStore(realistic_snapshot())
    collector = build_collector(store)

    def check() -> bytes:
        body = collector.exposition(encoder, content_type)
        assert body == encoder(build_registry(StateStore(store.snapshot)))
        return body

    first = check()
    assert check() is first  # the same snapshot: the same body object
    store.emit("note", None, "an event")
    assert check() == first
    c = store.snapshot.counters
    store.update(counters=replace(c, checks=c.checks + 1, last_check_at=c.last_check_at + 1))
    assert check() != first
    store.set_process(replace(store.snapshot.processes[0], state="failed", bound=False))
    store.count("bind_failures", (HOST_LABEL, "cgroup", "denied"))
    store.update(self_usage=SelfUsage(0.25, 123 << 20, 3.0))
    body = check()
    assert b"placement_supervisor_resident_memory_bytes 1.28974848e+08" in body
    store.update(
        placement=replace(store.snapshot.placement, ranks=store.snapshot.placement.ranks[:2])
    )
    assert b'placement_up{rank="3"}' not in check()  # counted series of rank 3 stay


def test_a_client_cannot_grow_the_format_cache() -> None:
    store = StateStore(realistic_snapshot())
    collector = build_collector(store)
    for minor in range(FORMATS_KEPT * 3):
        encoder, content_type = choose_encoder(f"application/openmetrics-text; version=1.{minor}.0")
        assert collector.exposition(encoder, content_type).endswith(b"# EOF\n")
    assert len(collector.renderer._formats) == FORMATS_KEPT


# -- the supervisor's own CPU and memory (psutil, sampled outside collect()) --------------


def _burn_cpu(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_self_usage_is_this_process_and_is_read_from_the_snapshot_only() -> None:
    process = psutil.Process()
    store = StateStore(realistic_snapshot())
    registry = build_registry(store)
    v = registry.get_sample_value
    assert v("placement_supervisor_cpu_seconds_total") is None  # no sample yet, no series
    assert v("placement_supervisor_resident_memory_bytes") is None

    store.update(self_usage=read_self_usage(process))
    cpu = v("placement_supervisor_cpu_seconds_total")
    rss = v("placement_supervisor_resident_memory_bytes")
    times = os.times()
    assert cpu is not None and 0 < cpu <= times.user + times.system + 0.01
    # /proc/self/statm's resident pages, as the kernel counts them now.
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert rss is not None and abs(rss - resident) < 64 << 20

    _burn_cpu(0.2)
    # Scraping does not sample: the value moves only with a new snapshot.
    assert v("placement_supervisor_cpu_seconds_total") == cpu
    with watching() as seen:
        generate_latest(registry)
    assert seen == []
    store.update(self_usage=read_self_usage(process))
    later = v("placement_supervisor_cpu_seconds_total")
    assert later is not None and later >= cpu + 0.15


def test_the_sampler_publishes_now_and_on_its_interval() -> None:
    store = StateStore(realistic_snapshot())

    async def run() -> list[SelfUsage]:
        seen: list[SelfUsage] = []
        task = asyncio.create_task(self_usage_loop(store, interval_s=0.05))
        try:
            for _ in range(200):
                usage = store.snapshot.self_usage
                if usage is not None and (not seen or usage is not seen[-1]):
                    seen.append(usage)
                if len(seen) >= 3:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return seen

    samples = asyncio.run(run())
    assert len(samples) == 3
    assert [s.sampled_at for s in samples] == sorted(s.sampled_at for s in samples)
    assert all(s.resident_memory_bytes > 0 and s.cpu_seconds > 0 for s in samples)


def test_local_memory_threshold_gauge_is_the_configured_threshold() -> None:
    """PlacementLocalMemoryLow compares the ratio with this gauge, so the daemon
    must export its own drift.local_memory_threshold, not a default."""
    doc = tomllib.loads((REPO / "supervisor" / "demo" / "demo.toml").read_text())
    doc.setdefault("drift", {})["local_memory_threshold"] = 0.83  # not the default 0.9
    config = parse_config(doc)
    fs = HostFS("/")
    topology, placement = prepare(config, {}, fs)
    daemon = Daemon(config, topology, placement, env={}, fs=fs, api=False)
    value = build_registry(daemon.store).get_sample_value("placement_local_memory_ratio_threshold")
    assert value == 0.83
    # A snapshot no config made has no threshold to export: no sample, not a made-up one.
    snap = replace(realistic_snapshot(), local_memory_threshold=None)
    assert registry_for(snap).get_sample_value("placement_local_memory_ratio_threshold") is None


def test_down_since_keeps_the_first_moment_a_process_was_not_running() -> None:
    """PlacementRankNotUp measures the readiness window from here: a failed load,
    its backoff and the next start keep the moment; running clears it."""
    snap = realistic_snapshot()
    store = StateStore(snap)
    v = build_registry(store).get_sample_value
    assert v("placement_down_since_timestamp_seconds", {"rank": "1"}) == 0.0  # running
    before = time.time()
    store.set_process(replace(snap.processes[1], state="starting", pid=None))
    went_down = v("placement_down_since_timestamp_seconds", {"rank": "1"})
    assert went_down is not None and before <= went_down <= time.time()
    # Starting -> backoff -> starting (the runner carries its status forward).
    for state in ("backoff", "starting", "backoff", "starting"):
        store.set_process(replace(store.snapshot.processes[1], state=state))  # type: ignore[arg-type]
        assert v("placement_down_since_timestamp_seconds", {"rank": "1"}) == went_down
    store.set_process(replace(store.snapshot.processes[1], state="running", pid=9))
    assert store.snapshot.processes[1].down_since is None
    assert v("placement_down_since_timestamp_seconds", {"rank": "1"}) == 0.0
    # A planned process with no status yet has been down since the daemon started.
    snap = replace(snap, processes={0: ProcessStatus(0, "running", pid=7)})
    assert (
        registry_for(snap).get_sample_value("placement_down_since_timestamp_seconds", {"rank": "1"})
        == snap.started_at
    )


def test_ready_timeout_gauge_is_the_configured_probe_timeout() -> None:
    doc = tomllib.loads((REPO / "supervisor" / "demo" / "demo.toml").read_text())
    doc["ready"]["timeout_s"] = 1200
    config = parse_config(doc)
    fs = HostFS("/")
    topology, placement = prepare(config, {}, fs)
    daemon = Daemon(config, topology, placement, env={}, fs=fs, api=False)
    assert build_registry(daemon.store).get_sample_value("placement_ready_timeout_seconds") == 1200
    # Without a [ready] probe there is no window: no sample (the alert then waits 5 minutes).
    snap = replace(realistic_snapshot(), ready_timeout_s=None)
    assert registry_for(snap).get_sample_value("placement_ready_timeout_seconds") is None
