"""The node agent with containers that containerd runs (issue 31), no kubelet.

A private containerd (tests/support/containerd.py: its own root, state and
socket, no CRI plugin) runs two fake `vllm serve` engines through its runc v2
shim with `ctr run`: one in the kubelet's cgroupfs layout, as containerd's CRI
plugin lays out a pod's container (`/kubepods/besteffort/pod<UID>/<ID>`), one
in the path `ctr` gives a container by default, `/<namespace>/<ID>`. Both are
found (the second under `--cgroup-root /<namespace>`, as an operator names a
runtime's own parent), each with the shim's child as its main process; the
agent, told the pod, places the pod's engine and leaves it running when it stops.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

from supervisor.agent.containers import Container, find_containers
from supervisor.hostfs import HostFS
from tests.support.agent_support import (
    agent_running,
    base_config,
    cgroup_parents,
    engine_bundle,
    placed,
    rank_cpus,
)
from tests.support.containerd import available, private_containerd
from tests.support.oci import kubelet_parents
from tests.support.poll import poll


def _by_id(namespace: str) -> dict[str, Container]:
    found = find_containers(HostFS("/"), extra_roots=[f"/{namespace}"])
    return {c.ref.container_id: c for c in found}


@pytest.mark.usefixtures("need_root")
def test_engines_containerd_runs_are_found_and_the_pod_s_is_placed(tmp_path: Path) -> None:
    why = available()
    if why is not None:
        pytest.skip(why)
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    pod = str(uuid.uuid4())
    namespace = f"ps-ctr-{uuid.uuid4().hex[:8]}"  # a test's name: the host check finds leftovers
    in_pod, plain = (uuid.uuid4().hex + uuid.uuid4().hex for _ in range(2))
    engine_bundle(tmp_path / "pod", tmp_path, f"/kubepods/besteffort/pod{pod}/{in_pod}", "0-1")
    engine_bundle(tmp_path / "plain", tmp_path, f"/{namespace}/{plain}", "1")
    with (
        kubelet_parents(pod),
        cgroup_parents(namespace),
        private_containerd(tmp_path / "containerd") as containerd,
    ):
        mains = {
            in_pod: containerd.start(namespace, tmp_path / "pod/config.json", in_pod),
            plain: containerd.start(namespace, tmp_path / "plain/config.json", plain),
        }

        def both_up() -> dict[str, Container] | None:
            found = _by_id(namespace)
            ok = all(cid in found and len(found[cid].pids) == 3 for cid in mains)
            return found if ok else None

        found = poll(both_up, 30, 0.2, what="both engines and their workers")
        pod_c, plain_c = found[in_pod], found[plain]
        assert (pod_c.ref.layout, pod_c.ref.pod_uid, pod_c.ref.qos) == (
            "kubelet-cgroupfs",
            pod,
            "besteffort",
        )
        assert (plain_c.ref.layout, plain_c.ref.cgroup) == ("extra", f"/{namespace}/{plain}")
        assert {cid: c.main.pid for cid, c in found.items() if cid in mains} == mains
        assert pod_c.kind == plain_c.kind == "vllm"
        assert (pod_c.cpus, plain_c.cpus) == ({0, 1}, {1})

        with agent_running(tmp_path, pods=[pod], base=base_config()) as agent:

            def pod_placed() -> list[dict[str, object]] | None:
                docs = agent.containers()
                ok = docs is not None and [d["container_id"] for d in docs] == [in_pod]
                return docs if ok and docs and placed(docs[0]) else None

            (doc,) = poll(pod_placed, 60, 0.5, what="the pod's engine placed")
            assert doc["share"] == "0-1" and doc["cgroup"] == pod_c.ref.cgroup
            assert rank_cpus(doc) == {0: "0", 1: "1"}, doc
            agent.proc.send_signal(signal.SIGTERM)
            assert agent.proc.wait(timeout=60) == 0, agent.log.read_text()[-4000:]
        # Both engines run on, as containerd started them.
        assert {cid: containerd.task_pid(namespace, cid) for cid in mains} == mains
        assert len(_by_id(namespace)[in_pod].pids) == 3
