"""The Grafana dashboard is code: configs/grafana/dashboard.py (grafana-foundation-sdk).

- The committed `placement-supervisor.json` is exactly the generator's output.
- A fleet is one job with one `instance` per host, and a node agent serves one
  supervisor per container under one `instance` (with its `namespace`, `pod` and
  `container`), so every aggregation groups by all four (KEEP) and every vector match
  is `on(...)` them: "All" must never add rank 0 of one host, or of one container, to
  rank 0 of another.
- Every metric name a panel or variable uses is one the daemon exports.

tests/serve/test_prometheus.py runs every query against a real Prometheus.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from supervisor.serve.metrics import build_registry
from supervisor.state import StateStore
from tests.support.api_fixture import realistic_snapshot

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "configs" / "grafana" / "dashboard.py"
DASHBOARD = REPO / "configs" / "grafana" / "placement-supervisor.json"
REGENERATE = (
    "regenerate it: .venv/bin/python configs/grafana/dashboard.py"
    " --out configs/grafana/placement-supervisor.json"
)

# PromQL's aggregation operators (https://prometheus.io/docs/prometheus/latest/querying/operators/).
AGGREGATIONS = (
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
)
# The operator, then `by (...)`/`without (...)` before the argument or none; `\b` and
# the `(` keep out metric names (`..._count`), functions (`max_over_time`) and group_left.
_AGGREGATION = re.compile(rf"\b({'|'.join(AGGREGATIONS)})\s*(?:(by|without)\s*\(([^)]*)\))?\s*\(")
_CLAUSE_AFTER = re.compile(r"\s*(by|without)\s*\(([^)]*)\)")
_MATCHING = re.compile(r"\b(on|ignoring)\s*\(([^)]*)\)")
_METRIC = re.compile(r"\bplacement_[a-z_]+")


def _labels(text: str | None) -> set[str]:
    return {label.strip() for label in (text or "").split(",") if label.strip()}


def _after_parens(expr: str, start: int) -> int:
    """The index just past the parenthesis that closes the one opened before `start`."""
    depth = 1
    i = start
    while depth:
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        i += 1
    return i


# These pick series and return them with all their labels, `instance` included:
# `topk(10, x)` over "All" hosts ranks the fleet's worst, it adds nothing up.
SELECTIONS = ("topk", "bottomk", "limitk", "limit_ratio")


# The labels that tell one supervisor's series from another's.
KEEP = frozenset({"instance", "namespace", "pod", "container"})


def instance_mergers(expr: str) -> list[str]:
    """The parts of `expr` that merge series of different hosts or of different
    containers of one node agent (empty when none do)."""
    found: list[str] = []
    for m in _AGGREGATION.finditer(expr):
        op, clause, labels = m.groups()
        if op in SELECTIONS:
            continue
        if clause is None:  # `sum(x) by (...)`, or no clause at all
            after = _CLAUSE_AFTER.match(expr, _after_parens(expr, m.end()))
            if after is not None:
                clause, labels = after.groups()
        keeps = (clause == "by" and _labels(labels) >= KEEP) or (
            clause == "without" and not KEEP & _labels(labels)
        )
        if not keeps:
            found.append(f"{op} {clause or ''}({labels or ''})")
    for m in _MATCHING.finditer(expr):
        keyword, labels = m.groups()
        on = keyword == "on"
        if (not _labels(labels) >= KEEP) if on else bool(KEEP & _labels(labels)):
            found.append(m.group(0))
    return found


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("placement_grafana_dashboard", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in doc["panels"] if p["type"] != "row"]


def exprs(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for p in panels(doc):
        for t in p["targets"]:
            yield p["title"], t["expr"]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            yield f"variable {var['name']}", var["query"]["query"]


def exported_names() -> set[str]:
    registry = build_registry(StateStore(realistic_snapshot()))
    return {s.name for m in registry.collect() for s in m.samples}


# -- generated, not edited ------------------------------------------------------------------


def test_committed_json_is_the_generators_output() -> None:
    assert DASHBOARD.read_text() == load_generator().render(), REGENERATE


@pytest.mark.parametrize("out", [False, True], ids=["stdout", "--out"])
def test_generator_command_line(tmp_path: Path, out: bool) -> None:
    target = tmp_path / "dashboard.json"
    argv = [sys.executable, str(GENERATOR), *(["--out", str(target)] if out else [])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    written = target.read_text() if out else proc.stdout
    assert written == DASHBOARD.read_text(), REGENERATE
    assert (proc.stdout == "") == out


# -- a fleet: per host ----------------------------------------------------------------------


def test_every_aggregation_and_match_keeps_the_host() -> None:
    """Graphs and tables keep each host apart; stat panels sum over the hosts chosen
    (one or two tiles for a fleet: issue 29), and say so in their descriptions."""
    doc = dashboard()
    stats = {p["title"] for p in panels(doc) if p["type"] == "stat"}
    checked = [
        (where, e) for where, e in exprs(doc) if _AGGREGATION.search(e) and where not in stats
    ]
    assert len(checked) >= 12  # the rule has something to judge
    bad = [(where, e, instance_mergers(e)) for where, e in checked if instance_mergers(e)]
    assert not bad, bad


def test_the_host_rule_catches_what_merges_hosts() -> None:
    merging = [
        "sum by (rank) (placement_up)",
        "sum(placement_up)",
        "sum(rate(placement_restarts_total[5m])) by (rank, reason)",
        "max without (instance) (placement_up)",
        "sum(topk(3, placement_threads))",
        'count(placement_up{instance=~"$host"})',
        "a * on(rank) group_left(policy) b",
        "a and ignoring(instance) b",
        "sum by (instance) (x) or on(rank) sum by (instance, rank) (y)",
        # One instance, a node agent's, serves several containers' ranks.
        "sum by (instance, rank) (placement_up)",
        "sum by (instance, namespace, pod, rank) (placement_up)",
        "a * on(instance, rank) group_left(policy) b",
        "a and ignoring(pod) b",
        "max without (container) (placement_up)",
    ]
    for expr in merging:
        assert instance_mergers(expr), expr
    keeping = [
        "sum by (instance, namespace, pod, container, rank) (placement_up)",
        "sum(rate(placement_restarts_total[5m])) by (rank, container, pod, namespace, instance)",
        "sum without (rank) (placement_up)",
        "max_over_time(placement_up[5m])",
        "rate(placement_check_duration_seconds_count[5m])",
        "a * on(instance, namespace, pod, container, rank) group_left(policy) b",
        "a / ignoring(rank) b",
        "topk(3, placement_threads)",  # a selection: each series keeps its instance
        "sort_desc(topk(10, sum by (instance, namespace, pod, container) (x) > 0))",
    ]
    for expr in keeping:
        assert not instance_mergers(expr), expr


def test_host_and_rank_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert list(variables) == ["datasource", "node", "host", "pod", "rank"]
    assert variables["node"]["query"]["query"] == "label_values(placement_info, node)"
    assert variables["node"]["allValue"] == ".*"  # off Kubernetes: no `node` label at all
    assert (
        variables["host"]["query"]["query"]
        == 'label_values(placement_info{node=~"$node"}, instance)'
    )
    assert variables["host"]["includeAll"] and variables["host"]["multi"]
    # The pods of the hosts chosen; "All" (.*) matches a series without a pod label too.
    assert (
        variables["pod"]["query"]["query"]
        == 'label_values(placement_up{instance=~"$host", node=~"$node"}, pod)'
    )
    assert variables["pod"]["includeAll"] and variables["pod"]["multi"]
    assert variables["pod"]["allValue"] == ".*"
    assert 'instance=~"$host"' in variables["rank"]["query"]["query"]
    assert 'pod=~"$pod"' in variables["rank"]["query"]["query"]


def test_tables_with_several_queries_join_them() -> None:
    joins = {"merge", "joinByField", "joinByLabels", "seriesToColumns"}
    tables = [p for p in panels(dashboard()) if p["type"] == "table"]
    assert tables
    for p in tables:
        used = {t["id"] for t in p.get("transformations", [])}
        assert len(p["targets"]) == 1 or used & joins, p["title"]


# -- names ----------------------------------------------------------------------------------


def test_every_metric_name_is_exported() -> None:
    exported = exported_names()
    for where, expr in exprs(dashboard()):
        names = set(_METRIC.findall(expr))
        assert names, (where, expr)
        # A summary's series are name_sum and name_count: those are its samples' names.
        assert names <= exported, (where, sorted(names - exported))


def test_the_name_rule_catches_an_unknown_name() -> None:
    exported = exported_names()
    assert "placement_local_memory_ratio_threshold" in exported
    assert set(_METRIC.findall("rate(placement_checks_total[5m])")) - exported
    assert set(_METRIC.findall('placement_up{rank=~"$rank"} / placement_ratio')) - exported


def test_the_issue_12_panels_are_there() -> None:
    shown = {name for _, expr in exprs(dashboard()) for name in _METRIC.findall(expr)}
    assert "placement_host_bind_failures_total" in shown
    assert "placement_local_memory_ratio_threshold" in shown
