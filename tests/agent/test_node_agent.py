"""The node agent (supervisor.agent.node) with real runc containers.

Two containers in the kubelet's cgroupfs layout, both allowed the same two
CPUs, each running a fake vLLM (`python3 .../vllm serve m`) whose two workers
carry LOCAL_RANK=0/1: the agent gives each one CPU, runs one attach-mode
supervisor per container within it, lists both in its /placement and labels
their metrics; a container deleted leaves the list and its supervisor exits; on
the agent's SIGTERM the other container's engine runs on. The pure parts (the
child's config, the metrics relabelling) are tested on their own, and the
loop's decisions (split, refuse, restart, stop) with the children recorded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tomllib
import urllib.request
import uuid
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.agent.containers import Container, ContainerRef, container_of
from supervisor.agent.kube_names import read_kube_names
from supervisor.agent.node import (
    LABEL_NAMES,
    AgentOptions,
    Managed,
    Names,
    NodeAgent,
    child_config,
    container_labels,
    format_labels,
    names_of,
    relabel_metrics,
    to_toml,
)
from supervisor.cpulist import format_cpulist, parse_cpulist
from supervisor.hostfs import HostFS
from supervisor.procfs.identity import ProcessId
from tests.support.children import thread_cpus
from tests.support.daemon_support import REPO, daemon_env, free_port, get_json, stop_process
from tests.support.kubelet import kubelet_link
from tests.support.oci import Profile, host_pids, kubelet_parents, make_bundle, runc, running, state
from tests.support.poll import poll


def test_the_child_config_attaches_by_cgroup_without_cgroups_of_its_own() -> None:
    base = {"cpu_ranks": 2, "engine": {"command": ["x"]}, "placement": {"rank_roles": {}}}
    doc = child_config(base, "/kubepods/podX/abc", "vllm")
    assert doc["cgroup"] == "off" and doc["workers"] == {"spawned_by": "engine"}
    assert doc["engine"] == {"attach": {"cgroup": "/kubepods/podX/abc"}, "kind": "vllm"}
    assert doc["irq"] == {"enabled": False}
    assert child_config({"irq": {"enabled": True}}, "/c", "vllm")["irq"] == {"enabled": True}
    # The share travels in the config (attach.cpus), not in the child's own affinity.
    shared = child_config(base, "/c", "vllm", frozenset({1, 2, 3, 8}))
    assert shared["engine"]["attach"] == {"cgroup": "/c", "cpus": "1-3,8"}
    assert base["engine"] == {"command": ["x"]}  # the base is left as it was
    assert tomllib.loads(to_toml(doc)) == doc


def test_metrics_get_the_container_s_labels_and_help_lines_once() -> None:
    text = '# HELP a_total A.\n# TYPE a_total counter\na_total 3\nb{rank="0"} 1.5\nc{} 2\n'
    seen: set[str] = set()
    first = relabel_metrics(text, 'container="x"', seen)
    assert first == [
        "# HELP a_total A.",
        "# TYPE a_total counter",
        'a_total{container="x"} 3',
        'b{container="x",rank="0"} 1.5',
        'c{container="x"} 2',
    ]
    assert relabel_metrics("# HELP a_total A.\na_total 4\n", 'container="y"', seen) == [
        'a_total{container="y"} 4'
    ]


UID = "0f2d8a9e-5b1c-4c7e-9f00-1234567890ab"
CID = "4b825dc642cb6eb9a060e54bf8d69288fbee4904" + "0" * 24


@pytest.mark.parametrize(
    ("cgroup", "named", "want"),
    [
        # Kubernetes, names found: the pod's and the container's.
        (f"/kubepods/burstable/pod{UID}/{CID}", True,
         {"namespace": "ml", "pod": "vllm-0", "pod_uid": UID, "container": "engine"}),
        # Kubernetes, no names (no log tree, or no link yet): ids only.
        (f"/kubepods/pod{UID}/{CID}", False, {"pod_uid": UID, "container": CID[:12]}),
        (f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope",
         False, {"pod_uid": UID, "container": CID[:12]}),  # a scope, but a pod's: no unit
        # Outside Kubernetes: the systemd unit, else the cgroup.
        (f"/system.slice/docker-{CID}.scope", False,
         {"container": CID[:12], "unit": f"docker-{CID}.scope"}),
        (f"/docker/{CID}", False, {"container": CID[:12], "cgroup": f"/docker/{CID}"}),
    ],
)  # fmt: skip
def test_every_series_gets_the_same_labels_named_as_well_as_known(
    tmp_path: Path, cgroup: str, named: bool, want: dict[str, str]
) -> None:
    kubelet_link(tmp_path / "log", "vllm-0", "ml", UID, container="engine", cid=CID)
    kube = read_kube_names(HostFS(str(tmp_path)), "log") if named else None
    ref = container_of(cgroup)
    assert ref is not None
    labels = container_labels(ref, names_of(ref, kube))
    assert tuple(labels) == LABEL_NAMES
    assert labels == dict.fromkeys(LABEL_NAMES, "") | {"container_id": CID[:12]} | want


def test_a_pod_without_its_container_s_link_is_named_by_its_directory(tmp_path: Path) -> None:
    (tmp_path / f"log/pods/ml_vllm-0_{UID}/engine").mkdir(parents=True)
    ref = container_of(f"/kubepods/pod{UID}/{CID}")
    assert ref is not None
    kube = read_kube_names(HostFS(str(tmp_path)), "log")
    assert names_of(ref, kube) == Names("ml", "vllm-0", None)
    assert container_labels(ref, names_of(ref, kube))["container"] == CID[:12]


def test_a_label_value_is_escaped_as_the_exposition_format_says() -> None:
    ref = ContainerRef('/runners/a"b\\c\nd', "x" * 12, "extra")
    text = format_labels(container_labels(ref, Names()))
    assert text.endswith(',unit="",cgroup="/runners/a\\"b\\\\c\\nd"'), text
    # prometheus_client's parser reads it back as it was.
    parsed = next(text_string_to_metric_families(f"m{{{text}}} 1\n")).samples[0].labels
    assert parsed["cgroup"] == ref.cgroup


# -- real containers ----------------------------------------------------------------------

FAKE_VLLM = """#!{python}
import os, subprocess, sys, time
# Two workers, as vLLM's API server spawns them, each with a thread of its own.
WORKER = ("import threading, time; "
          "threading.Thread(target=time.sleep, args=(600,)).start(); time.sleep(600)")
for rank in (0, 1):
    subprocess.Popen([sys.executable, "-c", WORKER], env=dict(os.environ, LOCAL_RANK=str(rank)))
time.sleep(600)
"""

BASE = """cpu_ranks = 2
stop_timeout_s = 2
[workers]
rank_from = ["env:LOCAL_RANK"]
[placement]
rank_roles = {}
on_shortage = "share"
[drift]
check_interval_s = 0.5
"""


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _placed(entry: dict[str, Any]) -> bool:
    """The container's two workers adopted and every thread of theirs within its share."""
    doc = entry.get("placement")
    if entry["state"] != "running" or not doc or len(doc["ranks"]) != 2:
        return False
    share = parse_cpulist(entry["share"])
    for r in doc["ranks"]:
        if r["state"] != "running" or not r["adopted"] or not r.get("pid"):
            return False
        cpus = set(thread_cpus(r["pid"]).values())
        if len(cpus) != 1 or not parse_cpulist(cpus.pop()) <= share:
            return False
        if format_cpulist(r["cpus"]) not in set(thread_cpus(r["pid"]).values()):
            return False
    return True


@pytest.mark.usefixtures("need_root")
def test_two_overlapping_runc_containers_are_placed_on_disjoint_shares(tmp_path: Path) -> None:
    if subprocess.run(["which", "runc"], capture_output=True, check=False).returncode:
        pytest.skip("runc is not installed (.ci/setup installs it)")
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    pod = str(uuid.uuid4())
    cids = sorted(uuid.uuid4().hex + uuid.uuid4().hex for _ in range(2))
    script = tmp_path / "bin/vllm"
    script.parent.mkdir()
    script.write_text(FAKE_VLLM.format(python=sys.executable))
    script.chmod(0o755)
    venv = Path(sys.executable).parent.parent
    binds = [str(tmp_path)] + ([] if venv.is_relative_to(REPO) else [str(venv)])
    for cid in cids:
        make_bundle(
            tmp_path / cid[:12],
            [sys.executable, str(script), "serve", "m"],
            {"PATH": "/usr/bin:/bin"},
            cgroups_path=f"/kubepods/besteffort/pod{pod}/{cid}",
            cpus="0-1",
            profile=Profile(privileged=False),
            binds=binds,
        )
    (tmp_path / "base.toml").write_text(BASE)
    # The kubelet's log tree (not the host's /var/log): a link for the first container;
    # the second has none yet, so its pod is named by the pod's directory alone.
    logs = tmp_path / "varlog"
    kubelet_link(logs, "vllm-0", "ml", pod, container="engine", cid=cids[0])
    (logs / f"pods/ml_vllm-0_{pod}/engine").mkdir(parents=True)
    port = free_port()
    agent: subprocess.Popen[bytes] | None = None
    log = tmp_path / "agent.log"
    try:
        with (
            kubelet_parents(pod),  # runc removes only the containers' own cgroups
            running(tmp_path / cids[0][:12], cids[0][:32], tmp_path / "runc0.log"),
            running(tmp_path / cids[1][:12], cids[1][:32], tmp_path / "runc1.log"),
        ):
            for cid in cids:
                poll(lambda c=cid: len(host_pids(c[:32])) == 3, 30, what="engine and 2 workers")
            with open(log, "wb") as out:
                agent = subprocess.Popen(
                    [
                        *(sys.executable, "-m", "supervisor", "agent"),
                        *("--listen", f"127.0.0.1:{port}", "--interval-s", "1", "--pod", pod),
                        *("--base-config", str(tmp_path / "base.toml")),
                        *("--state-dir", str(tmp_path / "state")),
                        *("--kube-logs", str(logs)),
                    ],
                    cwd=REPO,
                    env=daemon_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=out,
                )
            url = f"http://127.0.0.1:{port}"

            def both_placed() -> list[dict[str, Any]] | None:
                try:
                    docs = get_json(f"{url}/placement")["containers"]
                except OSError:
                    return None
                ok = [d["container_id"] for d in docs] == cids and all(map(_placed, docs))
                return docs if ok else None

            docs = poll(both_placed, 60, interval_s=0.5, what="both containers placed")
            assert [d["share"] for d in docs] == ["0", "1"], docs
            # The share is in each child's config: the child runs on the agent's CPUs.
            agent_cpus = os.sched_getaffinity(agent.pid)
            assert [os.sched_getaffinity(d["child_pid"]) for d in docs] == [agent_cpus] * 2
            assert all(d["cpus"] == "0-1" and d["pod_uid"] == pod for d in docs)
            assert all(d["kind"] == "vllm" and d["reason"] is None for d in docs)
            names = [(d["namespace"], d["pod"], d["container"]) for d in docs]
            assert names == [("ml", "vllm-0", "engine"), ("ml", "vllm-0", None)]
            metrics = _get_text(f"{url}/metrics")
            families = list(text_string_to_metric_families(metrics))
            ranks = {
                (s.labels["container"], s.labels["rank"])
                for f in families
                if f.name == "placement_up"
                for s in f.samples
            }
            assert ranks == {(c, r) for c in ("engine", cids[1][:12]) for r in ("engine", "0", "1")}
            for f in families:  # every sample: the seven labels, named as far as known
                for s in f.samples:
                    mine = {k: s.labels.get(k) for k in LABEL_NAMES}
                    container = "engine" if s.labels["container_id"] == cids[0][:12] else None
                    assert mine == {
                        "namespace": "ml",
                        "pod": "vllm-0",
                        "pod_uid": pod,
                        "container": container or cids[1][:12],
                        "container_id": (cids[0] if container else cids[1])[:12],
                        "unit": "",
                        "cgroup": "",
                    }, s

            # One container goes: its entry leaves /placement, its supervisor exits.
            gone_child = docs[0]["child_pid"]
            runc("kill", cids[0][:32], "KILL", check=False)
            poll(lambda: state(cids[0][:32]) in ("stopped", "gone"), 20, what="stopped")
            runc("delete", "--force", cids[0][:32], check=False)

            def left() -> bool:
                ids = [d["container_id"] for d in get_json(f"{url}/placement")["containers"]]
                return ids == [cids[1]]

            poll(left, 30, interval_s=0.5, what="the deleted container left /placement")
            poll(lambda: not Path(f"/proc/{gone_child}").exists(), 30, what="its child exited")

            # The other's share is now both CPUs: its supervisor is started again within them.
            def replaced() -> dict[str, Any] | None:
                (doc,) = get_json(f"{url}/placement")["containers"]
                return doc if doc["share"] == "0-1" and _placed(doc) else None

            last = poll(replaced, 60, interval_s=0.5, what="the other container placed on 0-1")

            # The agent's SIGTERM: exit 0, the other engine runs on.
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=60) == 0, log.read_text()[-4000:]
            assert len(host_pids(cids[1][:32])) == 3
            assert f"child stopped cgroup={last['cgroup']} pid={last['child_pid']} rc=0" in (
                log.read_text()
            )
            assert "detached" in (tmp_path / f"state/{cids[1][:12]}.log").read_text()
    finally:
        if agent is not None:
            stop_process(agent, 30)


# -- the loop's decisions, without processes -------------------------------------------------


class _Recording(NodeAgent):
    """The agent's pass with the node given and the children recorded, not started."""

    def __init__(self) -> None:
        super().__init__(AgentOptions(listen=("127.0.0.1", 0)))
        self.node: list[Container] = []
        self.calls: list[tuple[str, str, str]] = []

    def engines(self) -> list[tuple[Container, str]]:
        return [(c, "vllm") for c in self.node]

    async def start_child(self, m: Managed, key: tuple[object, ...]) -> None:
        self.calls.append(("start", m.container.ref.cgroup, format_cpulist(m.share)))
        m.key, m.proc = key, cast(Any, _Running())

    async def stop_child(self, m: Managed) -> None:
        if m.proc is not None:
            self.calls.append(("stop", m.container.ref.cgroup, format_cpulist(m.share)))
        m.proc = None


class _Running:
    returncode: int | None = None
    pid = 1


def _container(name: str, cpus: str, main: int = 100) -> Container:
    ref = ContainerRef(f"/runners/{name}", name, "extra")
    return Container(
        ref, ProcessId(main, 1), (main,), "vllm serve", "vllm", {}, parse_cpulist(cpus), None, ()
    )


def test_the_pass_splits_refuses_restarts_and_stops() -> None:
    agent = _Recording()
    agent.node = [_container("a", "0-1"), _container("b", "0-1"), _container("c", "0-1")]
    asyncio.run(agent.pass_once())
    assert agent.calls == [("start", "/runners/a", "0"), ("start", "/runners/b", "1")]
    refused = agent.managed["/runners/c"]
    assert refused.state == "refused" and refused.reason is not None
    assert refused.reason.startswith("cannot place: its CPUs 0-1 are all shared with")
    agent.calls.clear()
    asyncio.run(agent.pass_once())  # nothing changed: nothing done
    assert agent.calls == []
    # a goes: its child is stopped; b and c now split 0-1 (b restarted on its new share).
    agent.node = [_container("b", "0-1"), _container("c", "0-1")]
    asyncio.run(agent.pass_once())
    assert agent.calls == [
        ("stop", "/runners/a", "0"),
        ("stop", "/runners/b", "0"),  # its share is 0 now, no longer 1
        ("start", "/runners/b", "0"),
        ("start", "/runners/c", "1"),
    ]
    assert agent.managed["/runners/c"].reason is None
    agent.calls.clear()
    # c's engine restarted (a new main process): its child is started again.
    agent.node = [_container("b", "0-1"), _container("c", "0-1", main=200)]
    asyncio.run(agent.pass_once())
    assert agent.calls == [("stop", "/runners/c", "1"), ("start", "/runners/c", "1")]
