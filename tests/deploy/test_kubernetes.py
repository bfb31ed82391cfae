"""deploy/kubernetes: the kustomize build (kubectl's kustomize), each manifest against
the Kubernetes OpenAPI schemas of a pinned release (kubernetes-validate, strict), the
Operator resources' required fields, and the project's own checks: the probes hit
routes the API serves, the ConfigMap's config plans on a DGX H100 and inside the
pod's own CPU request, the dashboard and rules are the generated ones."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from supervisor.config import ApiConfig, load_config
from supervisor.examples.builder import GIB, FakeHost
from supervisor.listen import parse_listen
from supervisor.serve.status import http_request
from tests.deploy.manifests import (
    BASE,
    K8S_VERSION,
    KUBE,
    OVERLAY,
    REPO,
    by_kind,
    kustomize_build,
    load_yaml,
    one,
)
from tests.support.api_fixture import ServerThread, realistic_snapshot

CORE_KINDS = {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim"}
CONFIG_PATH = "/etc/placement-supervisor/config.toml"


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return kustomize_build(BASE)


@pytest.fixture(scope="module")
def overlay() -> list[dict[str, Any]]:
    return kustomize_build(OVERLAY)


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    assert not pod.get("initContainers")  # each would need Guaranteed resources too
    return pod["containers"][0]


def config_map_data(docs: list[dict[str, Any]], prefix: str) -> dict[str, str]:
    data: dict[str, str] = one(docs, "ConfigMap", prefix)["data"]
    return data


# -- schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["base", "overlay"])
def test_every_built_resource_validates_against_the_pinned_schemas(
    which: str, request: pytest.FixtureRequest
) -> None:
    docs: list[dict[str, Any]] = request.getfixturevalue(which)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodMonitor", "PrometheusRule"} <= kinds
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        else:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1", doc["kind"]


def test_every_resource_file_on_its_own_validates_too() -> None:
    # The files as written (what a reader copies), not only kustomize's output.
    for kustomization in (BASE / "kustomization.yaml", OVERLAY / "kustomization.yaml"):
        listed = yaml.safe_load(kustomization.read_text())["resources"]
        for entry in listed:
            path = (kustomization.parent / entry).resolve()
            assert path.exists(), f"{kustomization}: resources: {entry} does not exist"
            if path.is_dir():
                assert (path / "kustomization.yaml").exists(), path
                continue
            for doc in load_yaml(path):
                if doc["kind"] in CORE_KINDS:
                    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_catches_a_misspelt_field(base: list[dict[str, Any]]) -> None:
    # The control: strict validation does reject what the kubelet would ignore.
    deployment = json.loads(json.dumps(one(base, "Deployment")))
    probe_owner = deployment["spec"]["template"]["spec"]["containers"][0]
    probe_owner["readinesProbe"] = probe_owner.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_the_operator_resources_have_their_required_fields(base: list[dict[str, Any]]) -> None:
    # PodMonitor and PrometheusRule are CRDs (monitoring.coreos.com/v1), outside the
    # core schemas: what the operator needs, by hand.
    monitor = one(base, "PodMonitor")
    spec = monitor["spec"]
    pod_labels = one(base, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    # alerts.yml's PlacementSupervisorDown reads up{job="placement-supervisor"}.
    assert pod_labels[spec["jobLabel"]] == "placement-supervisor"
    (endpoint,) = spec["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in container(base)["ports"]}
    assert endpoint["port"] in ports
    assert endpoint["path"] == "/metrics"

    rule = one(base, "PrometheusRule")
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for r in group["rules"]:
            assert r.keys() & {"alert", "record"} and r["expr"], r


# -- the pod --------------------------------------------------------------------------


def test_the_pod_is_guaranteed_with_integer_cpus(base: list[dict[str, Any]]) -> None:
    # Guaranteed QoS (requests == limits for cpu and memory in every container) and
    # an integer CPU count: what the static CPU manager policy needs to give
    # exclusive CPUs (kubernetes.io/docs/tasks/administer-cluster/cpu-management-policies/).
    resources = container(base)["resources"]
    assert resources["requests"] == resources["limits"]
    cpu = resources["limits"]["cpu"]
    assert str(cpu).isdigit() and int(cpu) % 2 == 0, cpu  # whole SMT cores
    assert resources["limits"]["memory"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 8  # the config's TP size


def probes(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}


def test_probes_read_healthz_and_readyz_on_the_api_port(base: list[dict[str, Any]]) -> None:
    c = container(base)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    p = probes(c)
    assert p["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # A probe whose failure kills the container never waits for the model.
    assert p["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert p["startupProbe"]["httpGet"]["path"] == "/healthz"
    cfg = load_config(str(BASE / "vllm.toml"))
    listen = cfg.api.listen
    assert listen.host == "0.0.0.0"  # the kubelet probes the pod IP
    for probe in p.values():
        assert ports[probe["httpGet"]["port"]] == listen.port


def test_probe_timings_outlast_the_supervisor_start_and_a_stale_check(
    base: list[dict[str, Any]],
) -> None:
    p = probes(container(base))
    unit = (REPO / "systemd/placement-supervisor.service").read_text()
    start_s = int(next(ln for ln in unit.splitlines() if ln.startswith("TimeoutStartSec="))[16:])
    s = p["startupProbe"]
    assert s["periodSeconds"] * s["failureThreshold"] >= start_s
    # /healthz is 503 after max(30, 5 check intervals, 2 numa_maps passes) seconds
    # without a check (supervisor/watch/loop.py Checker.stale_after_s): liveness
    # must not fire before it.
    cfg = load_config(str(BASE / "vllm.toml"))
    stale_s = max(30.0, 5 * cfg.drift.check_interval_s, 2 * cfg.drift.numa_maps_interval_s)
    live = p["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 2 * stale_s
    # SIGTERM: workers, then the engine, each up to stop_timeout_s before KILL.
    pod = one(base, "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 2 * cfg.stop_timeout_s


def test_the_probe_paths_are_served_without_a_token(base: list[dict[str, Any]]) -> None:
    # The real ApiServer, with a token configured: the kubelet's probes and the
    # scrape carry no Authorization header and still get their answer (not 401/404).
    c = container(base)
    paths = {probe["httpGet"]["path"] for probe in probes(c).values()}
    paths.add(one(base, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["path"])
    with ServerThread(realistic_snapshot(), ApiConfig(listen=parse_listen("127.0.0.1:0"))) as srv:
        _, _, body = http_request(srv.tcp, "GET", "/openapi.json")
        served = {path for path, ops in json.loads(body)["paths"].items() if "get" in ops}
        for path in sorted(paths):
            assert path in served
            status, _, _ = http_request(srv.tcp, "GET", path)
            assert status in (200, 503), (path, status)


def test_the_config_map_mount_is_the_entrypoint_config(base: list[dict[str, Any]]) -> None:
    c = container(base)
    assert c["command"][-2:] == ["--config", CONFIG_PATH]
    mount = next(m for m in c["volumeMounts"] if CONFIG_PATH.startswith(m["mountPath"] + "/"))
    pod = one(base, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    sources = volume["projected"]["sources"]
    config_map = next(s["configMap"] for s in sources if "configMap" in s)
    (item,) = config_map["items"]
    assert item["path"] == CONFIG_PATH.rsplit("/", 1)[1]
    generated = one(base, "ConfigMap", "placement-supervisor-config")
    assert config_map["name"] == generated["metadata"]["name"]  # kustomize's hashed name
    assert item["key"] in generated["data"]
    # The token: mode 0400, as read_token_file demands, and no fsGroup to widen it.
    secret = next(s["secret"] for s in sources if "secret" in s)
    token_item = secret["items"][0]
    cfg = load_config(str(BASE / "vllm.toml"))
    assert cfg.stop_grace_s == pod["terminationGracePeriodSeconds"]  # the stop fits in it
    assert cfg.api.token_file == f"{mount['mountPath']}/{token_item['path']}"
    assert token_item["mode"] & 0o077 == 0
    assert "fsGroup" not in pod.get("securityContext", {})
    # The unix socket and the instance lock live in a writable emptyDir.
    assert cfg.api.unix_socket is not None
    run = next(m for m in c["volumeMounts"] if cfg.api.unix_socket.startswith(m["mountPath"]))
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == run["name"])


# -- the config -----------------------------------------------------------------------


def test_the_config_map_holds_the_pod_config_byte_for_byte(base: list[dict[str, Any]]) -> None:
    data = config_map_data(base, "placement-supervisor-config")
    assert data["config.toml"] == (BASE / "vllm.toml").read_text()


def test_the_pod_config_is_the_vllm_config_but_for_what_a_pod_changes() -> None:
    shipped = tomllib.loads((REPO / "configs/engines/vllm.toml").read_text())
    pod = tomllib.loads((BASE / "vllm.toml").read_text())
    assert shipped["engine"]["command"][0] == "/opt/vllm/bin/vllm"
    expected = json.loads(json.dumps(shipped))
    expected["engine"]["command"][0] = "vllm"  # the engine image's PATH
    expected["cgroup"] = "off"  # the kubelet is the only cgroup writer
    expected["irq"]["enabled"] = False  # /proc/irq is read-only in a container
    expected["api"]["listen"] = "0.0.0.0:9477"  # probes and scrapes come to the pod IP
    expected["stop_grace_s"] = 90  # the pod's terminationGracePeriodSeconds
    assert pod == expected


def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    """Every scalar of a TOML document by path: `api.listen`, `engine.command[0]`."""
    if isinstance(value, dict):
        return {
            k: v
            for key, sub in value.items()
            for k, v in _leaves(sub, f"{path}.{key}".lstrip(".")).items()
        }
    if isinstance(value, list):
        return {
            k: v for i, sub in enumerate(value) for k, v in _leaves(sub, f"{path}[{i}]").items()
        }
    return {path: value}


NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def test_the_docs_name_every_key_the_pod_config_changes_and_count_them() -> None:
    shipped = _leaves(tomllib.loads((REPO / "configs/engines/vllm.toml").read_text()))
    pod = _leaves(tomllib.loads((BASE / "vllm.toml").read_text()))
    changed = {p: pod.get(p) for p in shipped.keys() | pod.keys() if shipped.get(p) != pod.get(p)}
    text = (REPO / "docs/kubernetes.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `vllm.toml` |"))
    count = re.search(r"except for (\w+) keys", row)
    assert count is not None, row
    documented = {
        path: tomllib.loads(f"v = {value}")["v"]
        for path, value in re.findall(r"`([\w.\[\]]+) = ([^`]+)`", row)
    }
    assert documented == changed
    assert count.group(1) == NUMBER_WORDS[len(changed)], row
    assert f"the same {NUMBER_WORDS[len(changed)]} changes" in text


def test_the_pod_config_plans_on_a_dgx_h100() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor",
            "plan",
            "--config",
            str(BASE / "vllm.toml"),
            "--no-checks",
            "--example",
            "dgx-h100",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=_no_visibility_env(),
    )
    assert result.returncode == 0, result.stderr
    assert "nvidia7" in result.stdout


def _no_visibility_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        env.pop(name, None)
    return env


def dgx_pod(base_dir: Path, per_node_cores: int) -> Path:
    """A DGX H100 seen from a pod: the cpuset the static CPU manager would give the
    Deployment's request with full-pcpus-only and distribute-cpus-across-numa
    (`per_node_cores` whole cores of each socket, both SMT threads)."""
    h = FakeHost(base_dir / "dgx_pod").cpus(2, 56, 2, "intel", mem_per_node_bytes=1024 * GIB)
    h.distances([[10, 21], [21, 10]])
    n = per_node_cores
    cpus = f"0-{n - 1},56-{56 + n - 1},112-{112 + n - 1},168-{168 + n - 1}"
    h.cgroup_v2("/kubepods.slice/kubepods-podf00.slice/cri-containerd-ab12.scope", cpus, "0-1")
    for i, bus in enumerate(["1b", "43", "52", "61", "9d", "c3", "d1", "df"]):
        h.nvidia_gpu(f"0000:{bus}:00.0", 0 if i < 4 else 1)
    return h.build()


def plan_json(root: Path) -> tuple[int, dict[str, Any] | None, str]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor",
            "plan",
            "--config",
            str(BASE / "vllm.toml"),
            "--no-checks",
            "--root",
            str(root),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=_no_visibility_env(),
    )
    doc = json.loads(result.stdout) if result.returncode == 0 else None
    return result.returncode, doc, result.stderr


def test_the_cpu_request_is_enough_for_the_plan(base: list[dict[str, Any]], tmp_path: Path) -> None:
    cpus = int(container(base)["resources"]["limits"]["cpu"])
    rc, doc, err = plan_json(dgx_pod(tmp_path, cpus // 4))  # 2 sockets x 2 threads
    assert rc == 0, err
    assert doc is not None and doc["warnings"] == []
    allowed = sorted(c for e in [doc["engine"], *doc["ranks"]] for c in e["cpus"])
    assert len(allowed) == len(set(allowed)) <= cpus  # nothing shared, all in the pod
    for rank in doc["ranks"]:
        assert rank["mems"] == [rank["device"]["numa_node"]]


def test_half_the_cpu_request_would_not_do(tmp_path: Path) -> None:
    # The control: the check above can fail. 32 CPUs (8 cores a socket) cannot give
    # node 0's four ranks (3 whole cores each) and the engine their CPUs: exit 3.
    rc, _, err = plan_json(dgx_pod(tmp_path, 8))
    assert rc == 3, err
    assert "needs 3 cores" in err


# -- the generated dashboard and rules ---------------------------------------------------


def test_the_dashboard_config_map_is_the_generated_dashboard(
    base: list[dict[str, Any]],
) -> None:
    cm = one(base, "ConfigMap", "placement-supervisor-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the Grafana sidecar's
    original = (REPO / "configs/grafana/placement-supervisor.json").read_text()
    assert cm["data"]["placement-supervisor.json"] == original


def test_the_prometheus_rule_is_the_generated_rules(base: list[dict[str, Any]]) -> None:
    rule = one(base, "PrometheusRule")
    original = yaml.safe_load((REPO / "configs/prometheus/alerts.yml").read_text())
    assert rule["spec"] == original


def test_the_copies_are_current() -> None:
    # sync.py --check: byte-for-byte, what kustomize reads from base/.
    result = subprocess.run(
        [sys.executable, str(KUBE / "sync.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout


def test_the_sync_check_notices_a_stale_copy() -> None:
    # The control: render_rule embeds alerts.yml's text, so any edit shows.
    spec = importlib.util.spec_from_file_location("sync", KUBE / "sync.py")
    assert spec is not None and spec.loader is not None
    sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync)
    alerts = (REPO / "configs/prometheus/alerts.yml").read_text()
    assert sync.render_rule(alerts).encode() == (BASE / "prometheusrule.yaml").read_bytes()
    assert sync.render_rule(alerts.replace("for: 2m", "for: 3m", 1)) != sync.render_rule(alerts)


def test_the_overlay_keeps_the_base_pod_and_sets_its_own(overlay: list[dict[str, Any]]) -> None:
    c = container(overlay)
    assert c["image"].startswith("registry.example.com/")
    pod = one(overlay, "Deployment")["spec"]["template"]["spec"]
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {d["metadata"]["name"] for d in by_kind(overlay, "PersistentVolumeClaim")}
    for kind in ("PodMonitor", "PrometheusRule"):
        assert one(overlay, kind)["metadata"]["labels"]["release"] == "monitoring"
    assert {d["metadata"].get("namespace") for d in overlay} == {"llm"}
