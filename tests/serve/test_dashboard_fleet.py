"""The bind failure panels on a fleet: 20 hosts of 8 ranks, in a real Prometheus.

The daemon pre-initialises `placement_bind_failures_total` at 0 for every rank,
target and reason, so 20 hosts export ~3,700 series that are almost all 0. The
series here are exactly those label sets (from supervisor.serve.metrics), an hour
of them every 5 minutes, with failures on a few ranks of 12 hosts. They go into
TSDB blocks with `promtool tsdb create-blocks-from openmetrics`; a real
Prometheus serves them, and the panels' queries, read from the committed
dashboard JSON, are evaluated through its HTTP API as Grafana sends them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor.serve.metrics import BIND_REASONS, BIND_TARGETS, IRQ_ONLY_REASONS
from tests.support.daemon_support import (
    free_port,
    get_json,
    stop_process,
)
from tests.support.poll import poll

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "configs" / "grafana" / "placement-supervisor.json"
JOB = "placement-supervisor"
HOSTS = [f"gpu{i:02d}:9477" for i in range(1, 21)]
RANKS = [*(str(r) for r in range(8)), "engine"]
STEP_S = 300
SAMPLES = 13  # an hour, every 5 minutes
WORST = 10  # the dashboard's topk

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="needs prometheus and promtool",
)

# (host index, rank, target, reason) -> failures, all counted at the 30th minute.
# 12 hosts fail (distinct totals, so the ranking is one); gpu03 on two ranks.
FAILING: dict[tuple[int, str, str, str], int] = {
    (3, "2", "thread", "denied"): 40,
    (3, "6", "memory", "invalid"): 7,  # gpu03: 47 in all
    (12, "5", "irq", "managed"): 90,
    (7, "0", "thread", "gone"): 33,
    (1, "engine", "cgroup", "error"): 21,
    (19, "4", "process", "denied"): 18,
    (8, "7", "thread", "denied"): 15,
    (15, "1", "memory", "gone"): 12,
    (20, "3", "irq", "error"): 9,
    (5, "6", "thread", "invalid"): 6,
    (10, "2", "process", "gone"): 4,  # 11th: outside the top 10
    (14, "0", "thread", "denied"): 2,  # 12th: outside the top 10
}
JUMP_AT = 6  # the sample index (minute 30) where the counters step up


def label_sets() -> Iterator[dict[str, str]]:
    """Every series the daemon exports at 0 (metrics._bind_failure_labels' rule)."""
    for host in HOSTS:
        for rank in RANKS:
            for target in BIND_TARGETS:
                if target == "irq" and rank == "engine":
                    continue  # the engine owns no device: no IRQs
                reasons = BIND_REASONS + (IRQ_ONLY_REASONS if target == "irq" else ())
                for reason in reasons:
                    yield {
                        "instance": host,
                        "job": JOB,
                        "rank": rank,
                        "target": target,
                        "reason": reason,
                    }


def failures(labels: dict[str, str]) -> int:
    host = HOSTS.index(labels["instance"]) + 1
    return FAILING.get((host, labels["rank"], labels["target"], labels["reason"]), 0)


def openmetrics(start_s: int) -> tuple[str, int]:
    """The counters as OpenMetrics text (sample timestamps in seconds); and the count."""
    lines = [
        "# HELP placement_bind_failures Binds the kernel refused.",
        "# TYPE placement_bind_failures counter",
    ]
    count = 0
    for labels in label_sets():
        count += 1
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        n = failures(labels)
        for i in range(SAMPLES):
            value = n if i >= JUMP_AT else 0
            lines.append(f"placement_bind_failures_total{{{text}}} {value} {start_s + i * STEP_S}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n", count


@dataclass
class Fleet:
    base: str
    start_s: int
    end_s: int

    def get(self, path: str, **params: Any) -> Any:
        doc = get_json(f"{self.base}{path}?" + urllib.parse.urlencode(params), timeout_s=30)
        assert doc["status"] == "success", doc
        return doc["data"]["result"]


@contextmanager
def backfilled(tmp: Path, text: str, start_s: int, count_query: str, count: int) -> Iterator[Fleet]:
    """A real Prometheus serving `text` (OpenMetrics) backfilled with promtool into
    blocks under `tmp`, once `count_query` counts `count` series at the end."""
    source = tmp / "fleet.om"
    source.write_text(text)
    data = tmp / "data"
    made = subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", "-q", str(source), str(data)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    (tmp / "prometheus.yml").write_text("global: {}\n")
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        fleet = Fleet(f"http://127.0.0.1:{port}", start_s, start_s + (SAMPLES - 1) * STEP_S)

        def loaded() -> bool:
            if prom.poll() is not None:
                raise AssertionError((tmp / "prometheus.log").read_text()[-3000:])
            try:
                found = fleet.get("/api/v1/query", query=count_query, time=fleet.end_s)
            except OSError:
                return False
            return bool(found) and int(found[0]["value"][1]) == count

        poll(loaded, 120, 0.5, what="Prometheus serving the backfilled blocks")
        yield fleet
    finally:
        stop_process(prom, 20, group=True)
        log.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    # Two hours back, on a minute: inside the default retention, and not in the head.
    start_s = (int(time.time()) - 2 * 3600) // 60 * 60
    text, count = openmetrics(start_s)
    assert 3500 <= count <= 4000  # the ~3,700 series of 20 hosts x 8 ranks (+ engine)
    with backfilled(tmp, text, start_s, "count(placement_bind_failures_total)", count) as fleet:
        yield fleet


def panel_expr(title: str) -> str:
    doc = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in doc["panels"] if p.get("title") == title]
    (target,) = panel["targets"]
    expr: str = target["expr"]
    return expr


def as_grafana(expr: str, range_s: int) -> str:
    """Grafana's variables for "All" hosts and ranks and a dashboard range of `range_s`."""
    return (
        expr.replace("$node", ".*")  # "All" nodes: also series without a node label
        .replace("$pod", ".*")  # "All" pods: also series without a pod label
        .replace("$host", ".+")
        .replace("$rank", ".+")
        .replace("$__rate_interval", "10m")
        .replace("$__range", f"{range_s}s")
    )


def host_totals() -> dict[str, int]:
    totals: dict[str, int] = {}
    for (host, *_), n in FAILING.items():
        totals[HOSTS[host - 1]] = totals.get(HOSTS[host - 1], 0) + n
    return totals


def test_worst_hosts_table_is_the_top_10_most_first(fleet: Fleet) -> None:
    expr = as_grafana(panel_expr("Worst hosts: bind failures in range"), 3600)
    assert "topk(10," in expr
    result = fleet.get("/api/v1/query", query=expr, time=fleet.end_s)
    got = [(r["metric"]["instance"], float(r["value"][1])) for r in result]
    totals = host_totals()
    want = sorted(totals, key=lambda h: -totals[h])[:WORST]
    assert [host for host, _ in got] == want  # the 10 worst, most first; no zero host
    assert len(totals) > WORST  # the limit cut something
    for host, value in got:
        # increase() over exactly the hour of samples: the step, give or take extrapolation.
        assert value == pytest.approx(totals[host], rel=0.2), host
    assert all(set(r["metric"]) == {"instance"} for r in result)


def test_bind_failures_graph_draws_only_failing_series_of_the_worst_hosts(fleet: Fleet) -> None:
    expr = as_grafana(panel_expr("Bind failures"), fleet.end_s - fleet.start_s)
    # Grafana's range query over the dashboard's time range; `@ end()` is its end.
    result = fleet.get(
        "/api/v1/query_range", query=expr, start=fleet.start_s, end=fleet.end_s, step=STEP_S
    )
    drawn = {
        (r["metric"]["instance"], r["metric"]["rank"], r["metric"]["target"], r["metric"]["reason"])
        for r in result
    }
    totals = host_totals()
    worst = set(sorted(totals, key=lambda h: -totals[h])[:WORST])
    want = {
        (HOSTS[h - 1], rank, target, reason)
        for (h, rank, target, reason) in FAILING
        if HOSTS[h - 1] in worst
    }
    assert drawn == want  # 11 of ~3,700 series: both of gpu03's, none of gpu10's or gpu14's
    assert len(drawn) == WORST + 1
    for r in result:
        assert r["values"] and all(float(v) > 0 for _, v in r["values"]), r["metric"]
    # The old panel's query (every series, zeros too) would have drawn all of them.
    everything = fleet.get(
        "/api/v1/query",
        query='count(increase(placement_bind_failures_total{instance=~".+"}[10m]))',
        time=fleet.end_s,
    )
    assert int(everything[0]["value"][1]) > 3500
