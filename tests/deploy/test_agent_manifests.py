"""deploy/kubernetes/agent: the node agent's DaemonSet, validated offline as the in-pod
base is (kustomize build, kubernetes-validate strict against the pinned release, the
PodMonitor's fields), and the project's checks: the privileges are exactly those
docs/kubernetes.md argues for, every host mount is read-only and no cgroup is
writable, the ConfigMap's base config makes child configs that load, the args parse
with the CLI's parser, and the probes and the scrape hit routes a real agent serves.

Each check is a function that lists what is wrong with a build; each is run on the
build (nothing wrong) and on a copy with one thing broken (that thing reported), so
no check here passes whatever the manifests say.
"""

from __future__ import annotations

import copy
import os
import select
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from supervisor.agent.node import (
    ENGINE_KINDS,
    STOP_TIMEOUT_S,
    UP_TIMEOUT_S,
    child_config,
    free_port,
    load_base_config,
)
from supervisor.cli import build_parser
from supervisor.config import load_config
from supervisor.errors import ConfigError
from supervisor.toml_out import to_toml
from tests.deploy.manifests import (
    AGENT,
    AGENT_OVERLAY,
    K8S_VERSION,
    kustomize_build,
    load_yaml,
    one,
)

Docs = list[dict[str, Any]]
CORE_KINDS = {"Namespace", "ServiceAccount", "PriorityClass", "DaemonSet", "ConfigMap"}
# docs/kubernetes.md "Privileges" and daemonset.yaml's header say why each.
CAPABILITIES = {"SYS_NICE", "SYS_PTRACE", "DAC_OVERRIDE"}
# The host paths the agent reads, and nothing else of the host's.
HOST_PATHS = {
    "/sys/fs/cgroup",
    "/var/log/pods",
    "/var/log/containers",
    "/var/lib/kubelet/pod-resources",
}
CGROUP_ROOT = "/sys/fs/cgroup"


@pytest.fixture(scope="module")
def agent() -> Docs:
    return kustomize_build(AGENT)


@pytest.fixture(scope="module")
def agent_overlay() -> Docs:
    return kustomize_build(AGENT_OVERLAY)


def pod_spec(docs: Docs) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def agent_container(docs: Docs) -> dict[str, Any]:
    (c,) = pod_spec(docs)["containers"]
    assert isinstance(c, dict)
    return c


def broken(docs: Docs, change: Callable[[Docs], None]) -> Docs:
    """A deep copy of `docs` with `change` applied (the build itself is shared)."""
    copied = copy.deepcopy(docs)
    change(copied)
    return copied


# -- the checks -----------------------------------------------------------------------


def schema_problems(docs: Docs) -> list[str]:
    """Core kinds against the pinned release's schemas (strict: unknown fields are
    errors); the Operator's CRDs must at least be monitoring.coreos.com/v1."""
    problems: list[str] = []
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as err:
                problems.append(f"{doc['kind']} {doc['metadata']['name']}: {err}")
        elif doc.get("apiVersion") != "monitoring.coreos.com/v1":
            problems.append(f"{doc['kind']}: not a core kind nor monitoring.coreos.com/v1")
    return problems


def privilege_problems(docs: Docs) -> list[str]:
    pod = pod_spec(docs)
    sc = agent_container(docs).get("securityContext", {})
    caps = sc.get("capabilities", {})
    problems = []
    if pod.get("hostPID") is not True:
        problems.append("hostPID is not true: the agent cannot see other pods' processes")
    for field in ("hostNetwork", "hostIPC"):
        if pod.get(field):
            problems.append(f"{field} is set: the agent needs neither")
    if caps.get("drop") != ["ALL"]:
        problems.append(f"capabilities.drop is {caps.get('drop')}, not [ALL]")
    if set(caps.get("add", [])) != CAPABILITIES or len(caps.get("add", [])) != 3:
        problems.append(f"capabilities.add is {caps.get('add')}, not {sorted(CAPABILITIES)}")
    expected = {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsUser": 0,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for key, value in expected.items():
        if sc.get(key) != value:
            problems.append(f"securityContext.{key} is {sc.get(key)!r}, not {value!r}")
    if pod.get("automountServiceAccountToken") is not False:
        problems.append("a service account token is mounted: the agent uses no Kubernetes API")
    return problems


def mount_problems(docs: Docs) -> list[str]:
    """Every host path mounted read-only (the cgroup tree recursively where the
    runtime can), only the paths the agent reads, and nothing writable at or
    under /sys/fs/cgroup."""
    pod = pod_spec(docs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    problems = []
    host = {name: v["hostPath"]["path"] for name, v in volumes.items() if "hostPath" in v}
    if set(host.values()) != HOST_PATHS:
        problems.append(f"host paths {sorted(host.values())}, not {sorted(HOST_PATHS)}")
    for c in pod["containers"] + pod.get("initContainers", []):
        for m in c.get("volumeMounts", []):
            where = f"{c['name']}: {m['mountPath']}"
            source = host.get(m["name"])
            under_cgroup = (m["mountPath"] + "/").startswith(CGROUP_ROOT + "/") or (
                source is not None and (source + "/").startswith(CGROUP_ROOT + "/")
            )
            if (source is not None or under_cgroup) and m.get("readOnly") is not True:
                problems.append(f"{where} (host {source}) is writable")
            if under_cgroup and m.get("recursiveReadOnly") not in ("IfPossible", "Enabled"):
                problems.append(f"{where}: a cgroup mount must be read-only recursively")
            if source is not None and source != m["mountPath"]:
                problems.append(f"{where}: host {source} at another path (the agent has no --root)")
    return problems


def monitor_problems(docs: Docs) -> list[str]:
    """The PodMonitor selects the DaemonSet's pods, scrapes a named port they have, and
    keeps the children's container/pod labels."""
    monitor = one(docs, "PodMonitor")["spec"]
    labels = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"] for p in agent_container(docs)["ports"]}
    problems = []
    if not monitor["selector"]["matchLabels"].items() <= labels.items():
        problems.append(f"selector {monitor['selector']} does not select the pods {labels}")
    if monitor.get("jobLabel") not in labels:
        problems.append(f"jobLabel {monitor.get('jobLabel')} is not a pod label")
    for endpoint in monitor["podMetricsEndpoints"]:
        if endpoint.get("port") not in ports:
            problems.append(f"port {endpoint.get('port')} is not one of {sorted(ports)}")
        if endpoint.get("honorLabels") is not True:
            problems.append("honorLabels is not true: the engines' container/pod labels get lost")
    return problems


def pod_problems(docs: Docs) -> list[str]:
    """Scheduling and lifetime: the project's PriorityClass, GPU taints tolerated,
    no CPU limit, a grace period the children's stop fits in."""
    pod = pod_spec(docs)
    c = agent_container(docs)
    problems = []
    classes = {d["metadata"]["name"] for d in docs if d["kind"] == "PriorityClass"}
    if pod.get("priorityClassName") not in classes:
        problems.append(f"priorityClassName {pod.get('priorityClassName')} is not built here")
    for d in docs:
        if d["kind"] == "PriorityClass" and d.get("preemptionPolicy") != "Never":
            problems.append("the PriorityClass may preempt: it could evict an inference pod")
    tolerated = {(t.get("key"), t.get("effect")) for t in pod.get("tolerations", [])}
    if ("nvidia.com/gpu", "NoSchedule") not in tolerated:
        problems.append("the nvidia.com/gpu:NoSchedule taint is not tolerated")
    if "cpu" in c["resources"].get("limits", {}):
        problems.append("a CPU limit: CFS throttling of a placement daemon")
    if "memory" not in c["resources"].get("limits", {}):
        problems.append("no memory limit")
    if pod.get("terminationGracePeriodSeconds", 30) <= UP_TIMEOUT_S + STOP_TIMEOUT_S:
        problems.append("the grace period ends before the children have detached")
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    if pod.get("serviceAccountName") not in accounts:
        problems.append(f"serviceAccountName {pod.get('serviceAccountName')} is not built here")
    return problems


def config_problems(text: str, tmp: Path) -> list[str]:
    """The base config as the agent loads it, and the child config each engine kind
    gets from it, as the child's supervisor loads that."""
    path = tmp / "node.toml"
    path.write_text(text)
    problems = []
    try:
        base = load_base_config(str(path))
    except ValueError as err:  # tomllib.TOMLDecodeError
        return [f"node.toml: {err}"]
    for key in ("api", "cgroup"):
        if key in base:
            problems.append(f"node.toml sets {key}: the agent sets it per child")
    if "command" in base.get("engine", {}):
        problems.append("node.toml gives an engine command: children attach")
    if base.get("irq", {}).get("enabled", False) is not False:
        problems.append("node.toml turns IRQs on: /proc/irq is read-only in the pod")
    cgroup = "/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + "a" * 64 + ".scope"
    for kind in ENGINE_KINDS:
        child = tmp / f"child-{kind}.toml"
        child.write_text(to_toml(child_config(base, cgroup, kind)))
        try:
            config = load_config(str(child))
        except ConfigError as err:
            problems.append(f"the {kind} child's config: {err}")
            continue
        if config.cgroup != "off" or config.irq.enabled:
            problems.append(f"the {kind} child would write cgroups or IRQs")
    return problems


def args_problems(docs: Docs) -> list[str]:
    """The container's command and args, parsed by the CLI's own parser."""
    c = agent_container(docs)
    argv = [*c["command"][1:], *c.get("args", [])]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        return [f"the CLI refuses {argv}"]
    problems = []
    if args.command != "agent":
        problems.append(f"the command is {args.command}, not agent")
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    config_dir, _, name = args.base_config.rpartition("/")
    mount = mounts.get(config_dir)
    if mount is None or "configMap" not in volumes[mount["name"]]:
        problems.append(f"--base-config {args.base_config} is not in a ConfigMap mount")
    else:
        cm_name = volumes[mount["name"]]["configMap"]["name"]
        data = one(docs, "ConfigMap", cm_name)["data"]
        if name not in data:
            problems.append(f"ConfigMap {cm_name} has no {name}")
    state = mounts.get(args.state_dir)
    if state is None or "emptyDir" not in volumes[state["name"]]:
        problems.append(f"--state-dir {args.state_dir} is not a writable emptyDir")
    port = int(args.listen.rpartition(":")[2])
    if args.listen.rpartition(":")[0] != "0.0.0.0":
        problems.append("the API is not on the pod IP: the kubelet and Prometheus cannot reach it")
    if port not in {p["containerPort"] for p in c["ports"]}:
        problems.append(f"--listen port {port} is not a container port")
    return problems


# -- a real agent, for the probe paths -----------------------------------------------


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            status: int = resp.status
            return status
    except urllib.error.HTTPError as err:
        return err.code


def route_problems(docs: Docs, port: int) -> list[str]:
    """GET of each probe's path and the scrape's on an agent: anything but 200."""
    c = agent_container(docs)
    paths = [
        (k, c[k]["httpGet"]) for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c
    ]
    endpoints = one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    paths += [("PodMonitor", e) for e in endpoints]
    ports = {p["name"] for p in c["ports"]}
    problems = []
    for what, get in paths:
        if get["port"] not in ports:
            problems.append(f"{what}: port {get['port']} is not a container port")
        status = http_status(port, get["path"])
        if status != 200:
            problems.append(f"{what}: GET {get['path']} is {status}")
    return problems


@pytest.fixture(scope="module")
def running_agent(agent: Docs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """`placement-supervisor agent` with the DaemonSet's args, but for where it listens
    (loopback, a free port) and the paths of its mounts (the repo's node.toml, a
    temporary state dir): its port once it says it listens."""
    c = agent_container(agent)
    args = build_parser().parse_args([*c["command"][1:], *c["args"]])
    port = free_port()
    state = tmp_path_factory.mktemp("agent-state")
    argv = [sys.executable, "-m", "supervisor", "agent", "--listen", f"127.0.0.1:{port}"]
    argv += ["--base-config", str(AGENT / "node.toml"), "--state-dir", str(state)]
    argv += ["--interval-s", str(args.interval_s)]
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    said = b""
    try:
        # Its own line once the API is bound (supervisor/agent/node.py run()).
        while b"agent listening on" not in said:
            ready, _, _ = select.select([proc.stderr], [], [], 30)
            chunk = os.read(proc.stderr.fileno(), 4096) if ready else b""
            assert chunk, f"the agent did not start: {said.decode(errors='replace')}"
            said += chunk
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        proc.stderr.close()
    assert rc == 0, said.decode(errors="replace")


# -- the tests: each check on the build, then on a broken copy ----------------------------


def mount(docs: Docs, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        m for m in agent_container(docs)["volumeMounts"] if m["name"] == name
    )
    return found


@pytest.mark.parametrize("which", ["agent", "agent_overlay"])
def test_every_built_resource_validates_against_the_pinned_schemas(
    which: str, request: pytest.FixtureRequest
) -> None:
    docs: Docs = request.getfixturevalue(which)
    kinds = {d["kind"] for d in docs}
    assert CORE_KINDS | {"PodMonitor"} == kinds
    assert schema_problems(docs) == []


def test_the_schema_check_catches_a_misspelt_field(agent: Docs) -> None:
    # recursiveReadOnly misspelt: a kubelet would ignore it and mount the cgroup
    # tree's submounts writable; strict validation refuses it.
    def misspell(docs: Docs) -> None:
        m = mount(docs, "host-cgroup")
        m["recursiveReadonly"] = m.pop("recursiveReadOnly")

    problems = schema_problems(broken(agent, misspell))
    assert len(problems) == 1 and "recursiveReadonly" in problems[0], problems


def test_every_resource_file_on_its_own_validates_too() -> None:
    for kustomization in (AGENT / "kustomization.yaml", AGENT_OVERLAY / "kustomization.yaml"):
        listed = yaml.safe_load(kustomization.read_text())["resources"]
        for entry in listed:
            path = (kustomization.parent / entry).resolve()
            assert path.exists(), f"{kustomization}: resources: {entry} does not exist"
            if path.is_dir():
                assert (path / "kustomization.yaml").exists(), path
                continue
            assert schema_problems(load_yaml(path)) == [], path


def test_the_privileges_are_exactly_the_argued_ones(agent: Docs) -> None:
    assert privilege_problems(agent) == []


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        (lambda c, p: c["securityContext"]["capabilities"]["add"].append("SYS_ADMIN"), "add"),
        (lambda c, p: c["securityContext"]["capabilities"]["add"].remove("SYS_PTRACE"), "add"),
        (lambda c, p: c["securityContext"]["capabilities"].pop("drop"), "drop"),
        (lambda c, p: c["securityContext"].update(privileged=True), "privileged"),
        (lambda c, p: c["securityContext"].update(allowPrivilegeEscalation=True), "Escalation"),
        (lambda c, p: c["securityContext"].update(readOnlyRootFilesystem=False), "readOnlyRoot"),
        (lambda c, p: c["securityContext"].update(runAsUser=1000), "runAsUser"),
        (lambda c, p: c["securityContext"].pop("seccompProfile"), "seccomp"),
        (lambda c, p: p.update(hostPID=False), "hostPID"),
        (lambda c, p: p.update(hostNetwork=True), "hostNetwork"),
        (lambda c, p: p.pop("automountServiceAccountToken"), "token"),
    ],
)
def test_the_privilege_check_catches_each_widening(
    agent: Docs, change: Callable[[dict[str, Any], dict[str, Any]], None], reported: str
) -> None:
    problems = privilege_problems(broken(agent, lambda d: change(agent_container(d), pod_spec(d))))
    assert len(problems) == 1 and reported in problems[0], problems


def test_every_host_mount_is_read_only_and_no_cgroup_is_writable(agent: Docs) -> None:
    assert mount_problems(agent) == []


def _writable_cgroup_below(docs: Docs) -> None:
    # A second view of one container's cgroup, writable: what a "cpuset writer" needs.
    pod_spec(docs)["volumes"].append(
        {"name": "kubepods", "hostPath": {"path": "/sys/fs/cgroup/kubepods.slice"}}
    )
    agent_container(docs)["volumeMounts"].append(
        {"name": "kubepods", "mountPath": "/sys/fs/cgroup/kubepods.slice"}
    )


def _host_proc(docs: Docs) -> None:
    pod_spec(docs)["volumes"].append({"name": "proc", "hostPath": {"path": "/proc"}})
    agent_container(docs)["volumeMounts"].append(
        {"name": "proc", "mountPath": "/host/proc", "readOnly": True}
    )


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        (lambda d: mount(d, "host-cgroup").update(readOnly=False), "writable"),
        (lambda d: mount(d, "host-cgroup").pop("recursiveReadOnly"), "recursively"),
        (lambda d: mount(d, "pod-logs").pop("readOnly"), "writable"),
        (lambda d: mount(d, "container-logs").update(mountPath="/host/containers"), "path"),
        (_writable_cgroup_below, "writable"),
        (_host_proc, "host paths"),
    ],
)
def test_the_mount_check_catches_a_writable_or_extra_host_mount(
    agent: Docs, change: Callable[[Docs], None], reported: str
) -> None:
    problems = mount_problems(broken(agent, change))
    assert problems and any(reported in p for p in problems), problems


def test_the_monitor_scrapes_the_agents_named_port(agent: Docs) -> None:
    assert monitor_problems(agent) == []


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        (
            lambda d: one(d, "PodMonitor")["spec"]["selector"]["matchLabels"].update(
                {"app.kubernetes.io/name": "placement-supervisor"}
            ),
            "selector",
        ),
        (lambda d: agent_container(d)["ports"][0].update(name="http"), "port"),
        (lambda d: one(d, "PodMonitor")["spec"].update(jobLabel="app"), "jobLabel"),
        (
            lambda d: one(d, "PodMonitor")["spec"]["podMetricsEndpoints"][0].pop("honorLabels"),
            "honorLabels",
        ),
    ],
)
def test_the_monitor_check_catches_a_monitor_that_finds_nothing(
    agent: Docs, change: Callable[[Docs], None], reported: str
) -> None:
    problems = monitor_problems(broken(agent, change))
    assert len(problems) == 1 and reported in problems[0], problems


def test_the_pod_schedules_onto_gpu_nodes_and_stops_in_time(agent: Docs) -> None:
    assert pod_problems(agent) == []


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        (lambda d: pod_spec(d).update(priorityClassName="system-node-critical"), "priority"),
        (lambda d: one(d, "PriorityClass").pop("preemptionPolicy"), "preempt"),
        (lambda d: pod_spec(d)["tolerations"].pop(0), "nvidia.com/gpu"),
        (lambda d: agent_container(d)["resources"]["limits"].update(cpu="1"), "CPU limit"),
        (lambda d: agent_container(d)["resources"].pop("limits"), "memory"),
        (lambda d: pod_spec(d).update(terminationGracePeriodSeconds=30), "grace"),
        (lambda d: pod_spec(d).update(serviceAccountName="default"), "serviceAccount"),
    ],
)
def test_the_pod_check_catches_each_change(
    agent: Docs, change: Callable[[Docs], None], reported: str
) -> None:
    problems = pod_problems(broken(agent, change))
    assert len(problems) == 1 and reported in problems[0], problems


def test_the_config_map_holds_node_toml_byte_for_byte(agent: Docs) -> None:
    data = one(agent, "ConfigMap", "placement-supervisor-agent-config")["data"]
    assert data == {"node.toml": (AGENT / "node.toml").read_text()}


def test_the_base_config_makes_child_configs_that_load(agent: Docs, tmp_path: Path) -> None:
    data = one(agent, "ConfigMap", "placement-supervisor-agent-config")["data"]
    assert config_problems(data["node.toml"], tmp_path) == []


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        # A key the config loader does not know (its path is in the error).
        (lambda t: t.replace('strategy = "auto"', 'strategi = "auto"'), "strategi"),
        (lambda t: t.replace("enabled = false", "enabled = true"), "IRQs"),
        (lambda t: t + '\n[api]\nlisten = "0.0.0.0:9477"\n', "api"),
        (lambda t: t.replace("[placement]", "[placement"), "node.toml"),
    ],
)
def test_the_config_check_catches_a_bad_base_config(
    tmp_path: Path, change: Callable[[str], str], reported: str
) -> None:
    text = change((AGENT / "node.toml").read_text())
    problems = config_problems(text, tmp_path)
    assert problems and all(reported in p for p in problems), problems


def test_the_args_parse_with_the_cli_parser(agent: Docs) -> None:
    assert args_problems(agent) == []


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        (lambda c: c["args"].append("--kube-logz"), "refuses"),
        (lambda c: c["args"].__setitem__(3, "/etc/placement-supervisor/node.toml"), "ConfigMap"),
        (lambda c: c["args"].__setitem__(5, "/var/lib/placement-supervisor-agent"), "state-dir"),
        (lambda c: c["args"].__setitem__(1, "127.0.0.1:9460"), "pod IP"),
        (lambda c: c["args"].__setitem__(1, "0.0.0.0:9477"), "container port"),
    ],
)
def test_the_args_check_catches_bad_args(
    agent: Docs, change: Callable[[dict[str, Any]], None], reported: str
) -> None:
    problems = args_problems(broken(agent, lambda d: change(agent_container(d))))
    assert len(problems) == 1 and reported in problems[0], problems


def test_the_probes_and_the_scrape_hit_routes_the_agent_serves(
    agent: Docs, running_agent: int
) -> None:
    assert route_problems(agent, running_agent) == []


def test_the_route_check_catches_a_route_the_agent_does_not_serve(
    agent: Docs, running_agent: int
) -> None:
    # /readyz is the in-pod supervisor's readiness route; the agent has none.
    def readyz(docs: Docs) -> None:
        agent_container(docs)["livenessProbe"]["httpGet"]["path"] = "/readyz"

    problems = route_problems(broken(agent, readyz), running_agent)
    assert problems == ["livenessProbe: GET /readyz is 404"], problems


def test_the_overlay_keeps_the_base_and_limits_it_to_gpu_nodes(agent_overlay: Docs) -> None:
    for check in (privilege_problems, mount_problems, monitor_problems, pod_problems):
        assert check(agent_overlay) == [], check.__name__
    affinity = pod_spec(agent_overlay)["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert "nvidia.com/gpu.present" in keys
    assert agent_container(agent_overlay)["image"].startswith("registry.example.com/")
    assert one(agent_overlay, "PodMonitor")["metadata"]["labels"]["release"] == "monitoring"
    namespaced = [d for d in agent_overlay if d["kind"] not in ("Namespace", "PriorityClass")]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"placement-supervisor"}
