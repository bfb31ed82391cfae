"""The alert rules, the dashboard and the metrics, checked with the real Prometheus tools.

- `promtool check rules` / `test rules` (one unit test per alert) / `check config`.
- A real Prometheus (loopback, temp storage, 1 s scrapes and rule evaluation)
  scrapes two targets: the demo daemon (`python -m supervisor run --config
  supervisor/demo/demo.toml`) and the snapshot harness (`python -m
  tests.support.api_fixture`, an ApiServer over a planned 4-GPU snapshot), and a
  node agent's /metrics: the harness's series as the agent serves them for two
  containers of two pods (its own relabelling and labels, supervisor.agent.node).
  Against each target, every expression of every dashboard panel, both template
  variables, and every alert rule must return data through the HTTP query API
  (a panel that shows only non-zero series is checked without its `> 0`).
  tests/serve/test_dashboard_fleet.py loads 20 hosts of series for the bind
  failure panels.

Rule for alert expressions that are conditions (`x < 0.9` is empty when all is
well): when the expression returns nothing, each comparison with a number
(`== 0`, `> 60`, `>= 3`, `< 0.9`) is removed, each comparison with another
vector (`x < on(instance) group_left y`) becomes `x and on(instance) y`, each
`unless` becomes `and` (the series it removes must exist too), and the
rest must return data for the target, i.e. the series the alert watches exist
(on both sides of a comparison). Rules must also evaluate without error
(`health: ok`).
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor.agent.containers import ContainerRef
from supervisor.agent.node import Names, container_labels, format_labels, relabel_metrics
from supervisor.listen import parse_listen
from supervisor.serve.metrics import build_registry
from supervisor.serve.status import http_request
from supervisor.state import StateStore
from tests.support.api_fixture import realistic_snapshot
from tests.support.daemon_support import (
    free_port,
    get_json,
    run_supervisor,
    stop_process,
)
from tests.support.poll import wait_until

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "configs" / "prometheus"
DASHBOARD = REPO / "configs" / "grafana" / "placement-supervisor.json"
DEMO_CONFIG = REPO / "supervisor" / "demo" / "demo.toml"
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable
JOB = "placement-supervisor"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool")
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus")


# docs/contracts.md §5: the names every dashboard, alert and scrape may rely on.
REQUIRED_METRICS = (
    "placement_local_memory_ratio",
    "placement_memory_bytes",
    "placement_bind_failures_total",
    "placement_drift_events_total",
    "placement_rebinds_total",
    "placement_cpuset_changes_total",
    "placement_restarts_total",
    "placement_up",
    "placement_check_duration_seconds",
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=120, check=False
    )


# -- promtool -------------------------------------------------------------------------------


@needs_promtool
def test_alert_rules_check() -> None:
    proc = promtool("check", "rules", "alerts.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_alert_unit_tests_pass_and_cover_every_alert() -> None:
    proc = promtool("test", "rules", "alerts_test.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alerts = set(re.findall(r"^\s*- alert: (\w+)", (PROM_DIR / "alerts.yml").read_text(), re.M))
    tests = (PROM_DIR / "alerts_test.yml").read_text()
    # An alert is covered when a test expects it to fire (a non-empty exp_alerts).
    firing = set(re.findall(r"alertname: (\w+)\n\s*exp_alerts:\n\s*- exp_labels", tests))
    assert alerts == firing, f"alerts without a firing unit test: {sorted(alerts - firing)}"
    # And a case where it must not fire (something that is not wrong, or not yet).
    quiet = set(re.findall(r"alertname: (\w+)\n\s*exp_alerts: \[\]", tests))
    assert alerts == quiet, f"alerts without a must-not-fire unit test: {sorted(alerts - quiet)}"
    assert len(alerts) >= 8


@needs_promtool
def test_example_scrape_config_is_valid() -> None:
    proc = promtool("check", "config", "prometheus.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"job_name: {JOB}" in (PROM_DIR / "prometheus.yml").read_text()


# -- the dashboard, statically ----------------------------------------------------------


def dashboard_panels() -> list[dict[str, Any]]:
    doc = json.loads(DASHBOARD.read_text())
    return [p for p in doc["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard_panels() for t in p["targets"]]


def test_dashboard_shape_and_names() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert 36 <= doc["schemaVersion"] <= 41
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # Hosts of the chosen Kubernetes node(s) ("All" is .*: hosts without the label match).
    assert variables["host"]["query"]["query"] == (
        'label_values(placement_info{node=~"$node"}, instance)'
    )
    assert variables["node"]["query"]["query"] == "label_values(placement_info, node)"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    exported = {
        s.name
        for m in build_registry(StateStore(realistic_snapshot())).collect()
        for s in m.samples
    }
    for p in dashboard_panels():
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            assert 'instance=~"$host"' in t["expr"], (p["title"], t["expr"])
            assert 'pod=~"$pod"' in t["expr"], (p["title"], t["expr"])
            names = set(re.findall(r"\bplacement_[a-z_]+", t["expr"]))
            assert names and names <= exported, (p["title"], names - exported)
    # The required metrics of docs/contracts.md §5 each have a panel.
    shown = " ".join(e for _, e in dashboard_exprs())
    for name in (*REQUIRED_METRICS, "placement_process_state"):
        assert name in shown, name


# -- a real Prometheus -------------------------------------------------------------------------


def wait_for(what: str, probe: Callable[[], Any], deadline_s: float, procs: list[Proc]) -> Any:
    """Poll `probe` until it returns a truthy value; fail naming `what` at the deadline."""
    last: Any = None

    def answered() -> Any:
        nonlocal last
        for p in procs:
            if p.popen.poll() is not None:
                pytest.fail(f"{p.name} exited with {p.popen.returncode}:\n{p.output()}")
        try:
            last = probe()
        except (OSError, ValueError) as err:
            last = err
            return None
        return last

    value = wait_until(answered, deadline_s, 0.2)
    if not value:
        pytest.fail(f"timed out waiting for {what}; last: {last!r}")
    return value


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        stop_process(self.popen, 20, group=True)


def start(name: str, argv: list[str], tmp: Path, **kw: Any) -> Proc:
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True, **kw
        )
    return Proc(name, popen, log)


# The node agent's two containers: (pod name, pod UID, container id).
AGENT_PODS = (
    ("vllm-0", "0f2d8a9e-5b1c-4c7e-9f00-1234567890ab", "a" * 64),
    ("vllm-1", "9c1e7a52-0d3b-4f6e-8a11-fedcba098765", "b" * 64),
)


def serve_as_agent(upstream: str) -> http.server.ThreadingHTTPServer:
    """A /metrics that is `upstream`'s, as the node agent serves its children's: once
    per container, with that container's labels (the agent's own code)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with urllib.request.urlopen(f"http://{upstream}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            seen: set[str] = set()
            lines: list[str] = []
            for pod, uid, cid in AGENT_PODS:
                ref = ContainerRef(f"/kubepods/pod{uid}/{cid}", cid, "kubelet-cgroupfs", uid)
                labels = format_labels(container_labels(ref, Names("ml", pod, "engine")))
                lines += relabel_metrics(text, labels, seen)
            body = ("\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@dataclass
class Stack:
    prometheus: str  # base URL
    instances: dict[str, str]  # "daemon"/"harness" -> instance label
    procs: list[Proc]

    def query(self, expr: str) -> list[Any]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        doc = get_json(url)
        assert doc["status"] == "success", (expr, doc)
        result: list[Any] = doc["data"]["result"]
        return result


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if shutil.which("prometheus") is None:
        pytest.skip("no prometheus binary")
    tmp = tmp_path_factory.mktemp("prom")
    procs: list[Proc] = []
    agent: http.server.ThreadingHTTPServer | None = None
    try:
        # The demo daemon, with a private port for its engine's readiness probe
        # so that other demo runs on this machine cannot collide with it.
        daemon_port, engine_port = free_port(), free_port()
        config = tmp / "demo.toml"
        config.write_text(DEMO_CONFIG.read_text().replace("9478", str(engine_port)))
        daemon = start(
            "daemon",
            [
                PYTHON,
                "-m",
                "supervisor",
                "run",
                "--config",
                str(config),
                "--listen",
                f"127.0.0.1:{daemon_port}",
            ],
            tmp,
        )
        procs.append(daemon)
        harness = start(
            "harness", [PYTHON, "-m", "tests.support.api_fixture", "--listen", "127.0.0.1:0"], tmp
        )
        procs.append(harness)
        line = wait_for("the harness's address", harness.log.read_text, 30, procs)
        harness_addr = json.loads(line.splitlines()[0])["addresses"][0]
        daemon_addr = f"127.0.0.1:{daemon_port}"
        agent = serve_as_agent(harness_addr)
        agent_addr = f"127.0.0.1:{agent.server_address[1]}"
        prom_port = free_port()
        (tmp / "prometheus.yml").write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(PROM_DIR / "alerts.yml")],
                    "scrape_configs": [
                        {
                            "job_name": JOB,
                            "static_configs": [
                                {"targets": [daemon_addr, harness_addr, agent_addr]}
                            ],
                        }
                    ],
                }
            )
        )
        prom = start(
            "prometheus",
            [
                "prometheus",
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--log.level=warn",
            ],
            tmp,
        )
        procs.append(prom)
        base = f"http://127.0.0.1:{prom_port}"
        instances = {"daemon": daemon_addr, "harness": harness_addr, "agent": agent_addr}
        s = Stack(base, instances, procs)

        def targets_up() -> bool:
            doc = get_json(f"{base}/api/v1/targets")
            health = {t["labels"]["instance"]: t["health"] for t in doc["data"]["activeTargets"]}
            return all(health.get(addr) == "up" for addr in s.instances.values())

        wait_for("every target scraped", targets_up, 90, procs)
        yield s
    finally:
        if agent is not None:
            agent.shutdown()
        for p in reversed(procs):
            p.stop()


def substitute(expr: str, instance: str, pod: str = ".*") -> str:
    """Grafana's variables as Grafana would expand them for one host (and pod: "All")."""
    return (
        expr.replace("$host", instance)  # a regex matching itself: dots match dots too
        .replace("$pod", pod)
        .replace("$node", ".*")  # "All": outside Kubernetes no series has a node label
        .replace("$rank", ".+")
        .replace("$__rate_interval", "10s")
        .replace("$__interval", "2s")
        .replace("$__range", "1m")
    )


_COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*(bool\s+)?-?[0-9]+(\.[0-9]+)?")
_VECTOR_COMPARISON = re.compile(
    r"\s*(?:==|!=|>=|<=|>|<)\s*(?:bool\s+)?((?:on|ignoring)\s*\([^)]*\))"
    r"\s*(?:(?:group_left|group_right)\s*(?:\([^)]*\))?)?\s*"
)


_UNLESS = re.compile(r"\bunless\b")


def strip_conditions(expr: str) -> str:
    return _UNLESS.sub("and", _COMPARISON.sub("", _VECTOR_COMPARISON.sub(r" and \1 ", expr)))


def missing_until_deadline(
    stack: Stack, checks: list[tuple[str, str]], deadline_s: float
) -> list[tuple[str, str]]:
    """Poll until every (label, expr) returns data; returns those that never did."""
    missing = checks

    def none_missing() -> bool:
        nonlocal missing
        missing = [(label, expr) for label, expr in missing if not stack.query(expr)]
        return not missing

    wait_until(none_missing, deadline_s, 1.0)
    return missing


TARGETS = ["harness", "daemon", "agent"]
_NONZERO = re.compile(r"\s*>\s*0(?![.\d])")
# A panel's own filter: a comparison with a number that ends the query or one
# side of its top-level `and` (not one inside a group_left's parentheses).
_FILTER = re.compile(r"\s*(?:==|!=|>=|<=|>|<)\s*-?[0-9]+(?:\.[0-9]+)?(?=\s*$|\s+and\b)")


@needs_prometheus
@pytest.mark.parametrize("target", TARGETS)
def test_every_dashboard_query_returns_data(stack: Stack, target: str) -> None:
    instance = stack.instances[target]
    # The agent's one pod of two, as a user picks it; the others have no pod label
    # at all, and "All" (.*) must keep them.
    pod = AGENT_PODS[0][0] if target == "agent" else ".*"
    doc = json.loads(DASHBOARD.read_text())
    # Panels that show only what is wrong (bind failures `> 0`, processes down
    # `== 0`, a state other than running `== 1`) are checked without that
    # filter: the series under it must exist.
    checks = [
        (title, _FILTER.sub("", _NONZERO.sub("", substitute(expr, instance, pod))))
        for title, expr in dashboard_exprs()
    ]
    # The template variables: Grafana's label_values(metric, label) is the label API.
    for var in doc["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
        assert m, var["query"]
        selector = substitute(m.group(1), instance, pod)
        url = f"{stack.prometheus}/api/v1/label/{m.group(2)}/values?" + urllib.parse.urlencode(
            {"match[]": selector}
        )
        if var["name"] == "node":
            # The Kubernetes node (the PodMonitor's label): none here, and
            # "All" (.*) then keeps every host, as the host query shows.
            assert get_json(url)["data"] == []
            continue
        if var["name"] == "pod" and target != "agent":
            # Off a node agent (and off Kubernetes) no series has a pod label:
            # "All" (.*) keeps them, as every panel's query shows below.
            assert get_json(url)["data"] == []
            continue
        values = wait_for(f"variable {var['name']}", lambda u=url: get_json(u)["data"], 30, [])
        if var["name"] == "host":
            assert instance in values
    pods = get_json(
        f"{stack.prometheus}/api/v1/label/pod/values?"
        + urllib.parse.urlencode({"match[]": f'placement_up{{instance="{instance}"}}'})
    )["data"]
    assert pods == ([p for p, _, _ in AGENT_PODS] if target == "agent" else []), pods
    missing = missing_until_deadline(stack, checks, 45)
    assert not missing, f"{target}: panels without data: {missing}"
    if target == "agent":  # the pod chosen, and only it
        for title, expr in checks:
            shown = {r["metric"].get("pod") for r in stack.query(expr)}
            assert shown <= {pod, None}, (title, expr, shown)
            assert "vllm-1" not in shown


@needs_prometheus
@pytest.mark.parametrize("target", TARGETS)
def test_every_alert_rule_evaluates_and_watches_existing_series(stack: Stack, target: str) -> None:
    instance = stack.instances[target]
    doc = get_json(f"{stack.prometheus}/api/v1/rules?type=alert")
    rules = [r for g in doc["data"]["groups"] for r in g["rules"]]
    names = set(re.findall(r"^\s*- alert: (\w+)", (PROM_DIR / "alerts.yml").read_text(), re.M))
    assert {r["name"] for r in rules} == names
    only_here = f'placement_info{{instance="{instance}"}}'
    checks = [
        (r["name"], f"({strip_conditions(r['query'])}) and on(instance) {only_here}") for r in rules
    ]
    missing = missing_until_deadline(stack, checks, 45)
    assert not missing, f"{target}: alerts whose series are missing: {missing}"

    def evaluated() -> bool:
        doc = get_json(f"{stack.prometheus}/api/v1/rules?type=alert")
        rules = [r for g in doc["data"]["groups"] for r in g["rules"]]
        return all(r["health"] == "ok" and r.get("lastEvaluation") for r in rules)

    wait_for("rules evaluated with health ok", evaluated, 30, [])
    # The conditions judge real data right: the harness's snapshot has one
    # standing drift finding (rank 1), which makes exactly that alert pending;
    # the demo daemon is healthy; the agent serves the harness's series for two
    # containers: the alert stands for each of them, by its pod.
    drift = {"PlacementDriftPersists"}
    expected = {"harness": drift, "daemon": set(), "agent": drift}[target]

    def alerts() -> set[str]:
        found = stack.query(f'ALERTS{{instance="{instance}"}}')
        return {a["metric"]["alertname"] for a in found}

    wait_until(lambda: alerts() == expected, 20, 0.5)
    assert alerts() == expected
    if target == "agent":
        found = stack.query(f'ALERTS{{instance="{instance}"}}')
        assert sorted(a["metric"].get("pod") for a in found) == [p for p, _, _ in AGENT_PODS]


def test_strip_conditions_rule() -> None:
    assert strip_conditions("placement_local_memory_ratio < 0.9") == "placement_local_memory_ratio"
    assert strip_conditions('up{job="x"} == 0') == 'up{job="x"}'
    assert strip_conditions("placement_bound == 0 and placement_up == 1") == (
        "placement_bound and placement_up"
    )
    assert strip_conditions('a{job!="x"} > bool 60') == 'a{job!="x"}'
    assert strip_conditions("increase(x[10m]) >= 3") == "increase(x[10m])"
    assert strip_conditions("a < on(instance, job) group_left b") == "a and on(instance, job) b"
    assert strip_conditions("a > bool ignoring(rank) group_right(x) b") == "a and ignoring(rank) b"
    assert strip_conditions("a == 0 unless on(rank) (b == 1 and on(rank) c)") == (
        "a and on(rank) (b and on(rank) c)"
    )


@needs_prometheus
def test_status_against_the_demo_daemon(stack: Stack) -> None:
    """`placement-supervisor status` on the real daemon: every process's pid and state."""
    listen = stack.instances["daemon"]
    # Exit 0 means ready (4: answers, not ready): wait until /readyz says so.
    wait_for("the demo ready", lambda: get_json(f"http://{listen}/readyz"), 60, stack.procs)
    doc = json.loads(http_request(parse_listen(listen), "GET", "/placement")[2])
    proc = run_supervisor("status", "--listen", listen)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:] if line}
    for entry in [doc["engine"], *doc["ranks"]]:
        label = "engine" if "rank" not in entry else str(entry["rank"])
        assert rows[label][1:3] == [str(entry["pid"]), entry["state"]], proc.stdout


@needs_promtool
def test_promtool_accepts_the_demo_daemons_metrics(stack: Stack) -> None:
    """docs/contracts.md §5 on the live demo: every required name, and a clean promtool lint."""
    with urllib.request.urlopen(f"http://{stack.instances['daemon']}/metrics", timeout=10) as r:
        body = r.read().decode()
    names = {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line[:1] != "#"}
    for name in REQUIRED_METRICS:
        assert name in names or f"{name}_count" in names, name
    done = subprocess.run(
        ["promtool", "check", "metrics"],
        input=body,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
