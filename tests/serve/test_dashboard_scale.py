"""Every fleet panel on 20 hosts x 9 processes (8 ranks and the engine), in a real Prometheus.

The daemon pre-initialises its counters at 0 for every rank and kind or reason, so
a fleet exports thousands of series that stay 0; a few here are not. The series
(the label sets of supervisor.serve.metrics, each with the PodMonitor's `node`)
go into TSDB blocks with `promtool tsdb create-blocks-from openmetrics`, an hour
every 5 minutes; the panels' queries, read from the committed dashboard JSON, run
through Prometheus's HTTP API as Grafana sends them, and each returns the series
count the panel is meant to draw.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from supervisor.serve.metrics import DRIFT_KINDS, HOST_BIND_FAILURES, REBIND_REASONS
from supervisor.state import CAPABILITY_NAMES, RELOAD_RESULTS
from tests.serve.test_dashboard_fleet import (
    DASHBOARD,
    HOSTS,
    JOB,
    RANKS,
    SAMPLES,
    STEP_S,
    Fleet,
    as_grafana,
    backfilled,
    pytestmark,
)

__all__ = ["pytestmark"]

JUMP_AT = 6  # minute 30: counters step up, the dips of the ratio happen
NODES = {host: f"node-{i:02d}" for i, host in enumerate(HOSTS, 1)}
# (host index, rank) -> the local memory ratio from minute 30 on (0.99 elsewhere).
LOW_NOW = {
    (4, "3"): 0.42,
    (11, "0"): 0.55,
    (11, "7"): 0.61,
    (2, "engine"): 0.70,
    (17, "5"): 0.74,
    (8, "1"): 0.80,
    (20, "2"): 0.83,
    (6, "6"): 0.86,
    (13, "4"): 0.88,
    (9, "0"): 0.90,
    (15, "3"): 0.93,
    (1, "1"): 0.95,
}
# A dip over minutes 10-20 only, back to 0.99 after: lowest of all over the hour.
DIP = {(18, "6"): 0.30}
THRESHOLD = {h: 0.9 for h in HOSTS} | {HOSTS[3]: 0.95}
# Counters that step up at minute 30: (metric, host index, labels) -> amount.
DRIFTS = {
    (h, str(r), "thread_affinity"): 10 + h
    for h, r in [
        (1, 0),
        (2, 1),
        (3, 2),
        (4, 3),
        (5, 4),
        (6, 5),
        (7, 6),
        (8, 7),
        (9, 0),
        (10, 1),
        (11, 2),
        (12, 3),
    ]
}  # 12: the top 10 cuts two
FINDINGS = {
    (5, "2", "memory_locality"),
    (9, "engine", "thread_affinity"),
    (14, "1", "irq_affinity"),
}
REBINDS = {
    (3, "2", "thread_affinity"): 4,
    (3, "2", "memory_locality"): 2,
    (16, "0", "api"): 1,
    (19, "7", "cpuset_changed"): 3,
}
RESTARTS = {(7, "4"): 2, (12, "engine"): 5}
CPUSET_CHANGES = {10: 1, 20: 2}
RELOADS = {(1, "ok"): 2, (2, "ok"): 1, (3, "invalid"): 1, (4, "refused"): 1}
NOT_READY = {6, 15}
DOWN = {(6, "2"), (15, "engine"), (15, "0")}
OTHER_HASH = 13  # this host runs another config file
ON_DISK_EDITED = 5  # this host's file on disk is not the one in force
NO_MEMPOLICY = {2, 19}  # denied and wanted: missing
IRQ_DENIED_UNWANTED = 7  # denied, but no IRQ in the plan: not missing


class Writer:
    """OpenMetrics text, one family at a time (timestamps in seconds)."""

    def __init__(self, start_s: int) -> None:
        self.start_s = start_s
        self.lines: list[str] = []

    def family(self, name: str, kind: str) -> None:
        self.lines.append(f"# TYPE {name} {kind}")

    def series(self, name: str, labels: dict[str, str], values: list[float]) -> None:
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for i, value in enumerate(values):
            self.lines.append(f"{name}{{{text}}} {value!r} {self.start_s + i * STEP_S}")

    def text(self) -> str:
        return "\n".join([*self.lines, "# EOF"]) + "\n"


def host_labels(host: str) -> dict[str, str]:
    return {"instance": host, "job": JOB, "node": NODES[host]}


def step(amount: float) -> list[float]:
    return [amount if i >= JUMP_AT else 0 for i in range(SAMPLES)]


def constant(value: float) -> list[float]:
    return [value] * SAMPLES


def ratio_values(h: int, rank: str) -> list[float]:
    if (h, rank) in DIP:
        return [DIP[h, rank] if 2 <= i <= 4 else 0.99 for i in range(SAMPLES)]
    low = LOW_NOW.get((h, rank), 0.99)
    return [low if i >= JUMP_AT else 0.99 for i in range(SAMPLES)]


def openmetrics(start_s: int) -> str:
    w = Writer(start_s)
    hosts = list(enumerate(HOSTS, 1))
    w.family("placement_info", "gauge")
    for _, host in hosts:
        w.series("placement_info", host_labels(host), constant(1))
    w.family("placement_local_memory_ratio", "gauge")
    for h, host in hosts:
        for rank in RANKS:
            w.series(
                "placement_local_memory_ratio",
                host_labels(host) | {"rank": rank},
                ratio_values(h, rank),
            )
    w.family("placement_local_memory_ratio_threshold", "gauge")
    for _, host in hosts:
        w.series(
            "placement_local_memory_ratio_threshold", host_labels(host), constant(THRESHOLD[host])
        )
    per_rank: list[tuple[str, str, tuple[str, ...], Any]] = [
        (
            "placement_drift_events",
            "counter",
            DRIFT_KINDS,
            lambda h, r, v: step(DRIFTS.get((h, r, v), 0)),
        ),
        (
            "placement_drift_findings",
            "gauge",
            DRIFT_KINDS,
            lambda h, r, v: step(1) if (h, r, v) in FINDINGS else constant(0),
        ),
        (
            "placement_rebinds",
            "counter",
            REBIND_REASONS,
            lambda h, r, v: step(REBINDS.get((h, r, v), 0)),
        ),
    ]
    for name, kind, values, amount in per_rank:
        w.family(name, kind)
        label = "kind" if "drift" in name else "reason"
        sample = f"{name}_total" if kind == "counter" else name
        for h, host in hosts:
            for rank in RANKS:
                for v in values:
                    labels = host_labels(host) | {"rank": rank, label: v}
                    w.series(sample, labels, amount(h, rank, v))
    w.family("placement_restarts", "counter")
    w.family("placement_up", "gauge")
    for h, host in hosts:
        for rank in RANKS:
            labels = host_labels(host) | {"rank": rank}
            w.series("placement_restarts_total", labels, step(RESTARTS.get((h, rank), 0)))
            w.series("placement_up", labels, constant(0 if (h, rank) in DOWN else 1))
    w.family("placement_cpuset_changes", "counter")
    w.family("placement_host_bind_failures", "counter")
    w.family("placement_config_reloads", "counter")
    w.family("placement_ready", "gauge")
    w.family("placement_config_info", "gauge")
    w.family("placement_config_on_disk_info", "gauge")
    w.family("placement_config_last_reload_successful", "gauge")
    w.family("placement_capability", "gauge")
    w.family("placement_capability_wanted", "gauge")
    w.family("placement_last_check_timestamp_seconds", "gauge")
    for h, host in hosts:
        labels = host_labels(host)
        w.series("placement_cpuset_changes_total", labels, step(CPUSET_CHANGES.get(h, 0)))
        for target, reason in HOST_BIND_FAILURES:
            w.series(
                "placement_host_bind_failures_total",
                labels | {"target": target, "reason": reason},
                constant(0),
            )
        for result in RELOAD_RESULTS:
            w.series(
                "placement_config_reloads_total",
                labels | {"result": result},
                step(RELOADS.get((h, result), 0)),
            )
        w.series("placement_ready", labels, constant(0 if h in NOT_READY else 1))
        sha = "b" * 64 if h == OTHER_HASH else "a" * 64
        path = {"path": "/etc/placement-supervisor/config.toml"}
        w.series("placement_config_info", labels | path | {"sha256": sha}, constant(1))
        disk = "c" * 64 if h == ON_DISK_EDITED else sha
        w.series("placement_config_on_disk_info", labels | path | {"sha256": disk}, constant(1))
        w.series("placement_config_last_reload_successful", labels, constant(1))
        for name in CAPABILITY_NAMES:
            denied = (name == "mempolicy" and h in NO_MEMPOLICY) or (
                name == "irq" and h == IRQ_DENIED_UNWANTED
            )
            unwanted = name == "irq" and h == IRQ_DENIED_UNWANTED
            w.series("placement_capability", labels | {"name": name}, constant(0 if denied else 1))
            w.series(
                "placement_capability_wanted",
                labels | {"name": name},
                constant(0 if unwanted else 1),
            )
        behind_s = 30 if h == 9 else 1  # gpu09's checks lag
        checked = [start_s + i * STEP_S - behind_s for i in range(SAMPLES)]
        w.series("placement_last_check_timestamp_seconds", labels, checked)
    return w.text()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("scale")
    start_s = (int(time.time()) - 2 * 3600) // 60 * 60
    count = len(HOSTS) * len(RANKS)
    with backfilled(tmp, openmetrics(start_s), start_s, "count(placement_up)", count) as fleet:
        yield fleet


def panel(title: str) -> dict[str, Any]:
    doc = json.loads(DASHBOARD.read_text())
    (found,) = [p for p in doc["panels"] if p.get("title") == title]
    return found


def drawn(fleet: Fleet, expr: str, **variables: str) -> list[dict[str, Any]]:
    """A graph's query over the hour, as Grafana's range query sends it."""
    text = as_grafana(expr, fleet.end_s - fleet.start_s)
    for name, value in variables.items():
        text = text.replace(f"${name}", value)
    result: list[dict[str, Any]] = fleet.get(
        "/api/v1/query_range", query=text, start=fleet.start_s, end=fleet.end_s, step=STEP_S
    )
    return result


def instant(fleet: Fleet, expr: str) -> list[dict[str, Any]]:
    """A table's or stat's instant query at the range's end."""
    text = as_grafana(expr, fleet.end_s - fleet.start_s)
    result: list[dict[str, Any]] = fleet.get("/api/v1/query", query=text, time=fleet.end_s)
    return result


def exprs(title: str) -> dict[str, str]:
    return {t["refId"]: t["expr"] for t in panel(title)["targets"]}


def pairs(result: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(r["metric"]["instance"], r["metric"]["rank"]) for r in result}


def host(h: int) -> str:
    return HOSTS[h - 1]


def test_local_memory_ratio_graph_draws_the_lowest_5_and_their_thresholds(fleet: Fleet) -> None:
    q = exprs("Local memory ratio: the lowest 5")
    lines = drawn(fleet, q["A"])
    # lowest over the hour: the dip that recovered, then the 4 lowest now (not 180 lines)
    lowest = sorted({**DIP, **LOW_NOW}.items(), key=lambda kv: kv[1])[:5]
    assert pairs(lines) == {(host(h), r) for (h, r), _ in lowest}
    thresholds = drawn(fleet, q["B"])
    assert {r["metric"]["instance"] for r in thresholds} == {host(h) for (h, _), _ in lowest}
    assert len(thresholds) == 4  # gpu11 holds two of the five: one line for its host


def test_lowest_ratio_table_lists_10_pairs_lowest_first(fleet: Fleet) -> None:
    (expr,) = exprs("Lowest local memory ratio now").values()
    rows = instant(fleet, expr)
    want = sorted(LOW_NOW.items(), key=lambda kv: kv[1])[:10]
    assert [(r["metric"]["instance"], r["metric"]["rank"]) for r in rows] == [
        (host(h), rank) for (h, rank), _ in want
    ]


@pytest.mark.parametrize(
    ("title", "want"),
    [
        ("Drift events", 10),  # 12 series not 0: the top 10
        ("Current drift findings", len(FINDINGS)),
        ("Re-binds", len(REBINDS)),
        ("Restarts", len(RESTARTS)),
        ("Cpuset changes", len(CPUSET_CHANGES)),
        ("Supervisor bind failures", 0),  # all 0: nothing drawn
        ("Config reloads", len(RELOADS)),
    ],
)
def test_counter_panels_draw_only_what_is_not_zero(fleet: Fleet, title: str, want: int) -> None:
    (expr,) = exprs(title).values()
    lines = drawn(fleet, expr)
    assert len(lines) == want, [r["metric"] for r in lines]
    assert panel(title)["options"]["legend"]["sortBy"] == "Total"


def test_drift_events_keeps_the_10_with_the_most(fleet: Fleet) -> None:
    (expr,) = exprs("Drift events").values()
    got = pairs(drawn(fleet, expr))
    top = sorted(DRIFTS.items(), key=lambda kv: -kv[1])[:10]
    assert got == {(host(h), r) for (h, r, _), _ in top}


@pytest.mark.parametrize(
    ("title", "want"),
    [
        ("Hosts not ready", [len(NOT_READY)]),
        ("Processes running", [len(HOSTS) * len(RANKS) - len(DOWN), len(HOSTS) * len(RANKS)]),
        ("Restarts in range", [sum(RESTARTS.values())]),
        ("Last check age", [30]),
        ("Config in force", [1]),  # the edited file on disk; the other hash is in force
        ("Local memory threshold", [0.9, 0.95]),
    ],
)
def test_stat_panels_are_one_tile_per_query_over_all_hosts(
    fleet: Fleet, title: str, want: list[float]
) -> None:
    got = []
    for expr in exprs(title).values():
        result = instant(fleet, expr)
        assert len(result) == 1, (title, expr, result)  # not 20 tiles
        got.append(float(result[0]["value"][1]))
    assert got == pytest.approx(want, rel=0.25), title


def test_config_and_capability_tables(fleet: Fleet) -> None:
    (expr,) = exprs("Config in force per host").values()
    rows = instant(fleet, expr)
    assert len(rows) == len(HOSTS)
    assert [r["metric"]["instance"] for r in rows if r["metric"]["sha256"] != "a" * 64] == [
        host(OTHER_HASH)
    ]
    (expr,) = exprs("Missing capabilities").values()
    rows = instant(fleet, expr)
    assert {(r["metric"]["instance"], r["metric"]["name"]) for r in rows} == {
        (host(h), "mempolicy") for h in NO_MEMPOLICY
    }  # the unwanted IRQ denial is not listed


def test_node_variable_narrows_every_query_to_that_node(fleet: Fleet) -> None:
    doc = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    nodes = fleet.get("/api/v1/query", query="count by (node) (placement_info)", time=fleet.end_s)
    assert len(nodes) == len(HOSTS)
    assert "$node" in variables["host"]["query"]["query"]
    # gpu04's node alone: the lowest-ratio graph draws 5 of its ranks, rank 3 among them
    expr = exprs("Local memory ratio: the lowest 5")["A"].replace("$node", NODES[host(4)])
    got = pairs(drawn(fleet, expr))
    assert len(got) == 5 and {h for h, _ in got} == {host(4)} and (host(4), "3") in got


# Panels of one process's detail (threads, memory per node, the plan's CPUs): read
# for a host chosen in the Host variable, one line per rank and role or node.
DETAIL = {"Threads per role", "Memory by NUMA node", "Plan and memory policy"}


def test_every_panel_draws_at_most_20_series(fleet: Fleet) -> None:
    """No panel's query returns one series per host and rank (180) or per label set,
    except the detail panels, which say to choose a host."""
    doc = json.loads(DASHBOARD.read_text())
    for p in doc["panels"]:
        if p.get("title") in DETAIL:
            assert "choose a host" in p["description"], p["title"]
            continue
        for t in p.get("targets", ()):
            result = instant(fleet, t["expr"]) if t.get("instant") else drawn(fleet, t["expr"])
            assert len(result) <= len(HOSTS), (p["title"], t["expr"], len(result))


def test_the_backfill_is_a_fleet(fleet: Fleet) -> None:
    total = fleet.get("/api/v1/query", query="count({__name__=~'placement_.+'})", time=fleet.end_s)
    assert int(total[0]["value"][1]) > 4000
