"""A vLLM-shaped engine in a real runc container, ranked by what its own processes
show: their setproctitle titles and the device files they hold open inside the
container's mount namespace (issue 31's container tests).

The stand-in is the fake vLLM of tests/support/fake_engine/layouts.py, run as
`python -m vllm.entrypoints.openai.api_server --tensor-parallel-size 2` (the
engine kind comes from that command line): an API server, one engine core, two
workers started by multiprocessing "spawn" and titled `VLLM::Worker_TP0` and
`VLLM::Worker_TP1` by the real setproctitle, with no LOCAL_RANK in their
environment (vLLM's workers take their rank as an argument). With
FAKE_ENGINE_OPEN_DEVICE=reverse the TP0 worker opens /dev/nvidia1 and TP1
/dev/nvidia0, and keeps it open, as a CUDA context holds its GPU: the device
disagrees with the title and wins (docs/engine-kinds.md), one `rank_conflict`
for each.

The container's /dev is runc's own tmpfs, with nvidia0 and nvidia1 made from
/dev/null's numbers (1:3); the agent runs in a mount namespace of its own whose
/dev has the same two nodes (ray_support.PRIVATE_DEV), so that its child's
discovery finds two NVIDIA GPUs and plans one rank per GPU; the host's /dev is
not touched. The workers record, in a directory the container shares, which
device each drives under its pid in the container's own pid namespace; the test
maps those to host pids through NSpid.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor.cpulist import format_cpulist
from supervisor.examples.builder import FakeHost
from tests.support.agent_support import Agent, agent_running, binds_for
from tests.support.children import thread_cpus
from tests.support.daemon_support import REPO
from tests.support.fake_engine.layouts import OPEN_DEVICE_ENV
from tests.support.fake_engine.shims import VLLM_MODULE, records, write_shim
from tests.support.kubelet import kubelet_link, list_answer, pod_resources_server
from tests.support.oci import (
    Profile,
    container_pid,
    host_pids,
    kubelet_parents,
    make_bundle,
    running,
)
from tests.support.poll import poll
from tests.support.ray_support import PRIVATE_DEV_PREFIX, title

# unshare(1) and mount(2) into a new mount namespace need CAP_SYS_ADMIN.
pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_root")]

NULL = (1, 3)  # /dev/null's numbers: openable with no driver
BASE = """accelerator = "nvidia"
stop_timeout_s = 2
[placement]
rank_roles = {}
on_shortage = "share"
[drift]
check_interval_s = 0.5
"""


def vllm_bundle(
    bundle: Path,
    tmp: Path,
    cgroup: str,
    record: Path,
    *,
    nodes: Sequence[tuple[str, int, int]] = tuple((f"/dev/nvidia{n}", *NULL) for n in (0, 1)),
    open_device: bool = True,
) -> None:
    shims = tmp / "shims"
    write_shim(shims, VLLM_MODULE, "vllm_main")
    command = [sys.executable, "-m", VLLM_MODULE, "--model", "m"]
    command += ["--tensor-parallel-size", "2", "--record-dir", str(record)]
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{shims}{os.pathsep}{REPO}",
    }
    if open_device:
        env[OPEN_DEVICE_ENV] = "reverse"
    make_bundle(
        bundle,
        command,
        env,
        cgroups_path=cgroup,
        cpus="0-1",
        profile=Profile(privileged=False),
        binds=binds_for(tmp),
        devices=nodes,
    )


@dataclass(frozen=True, slots=True)
class Engine:
    pod: str
    cid: str
    record: Path  # where its workers record the device each drives
    bundle: Path


def engine_bundle(tmp: Path, **bundle: Any) -> Engine:
    """A fake vLLM's runc bundle in a new pod's kubelet layout (vllm_bundle's
    `bundle` options), its record directory, and the agent's directory."""
    pod = str(uuid.uuid4())
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    record = tmp / "record"
    record.mkdir()
    (tmp / "agent").mkdir()
    path = tmp / cid[:12]
    vllm_bundle(path, tmp, f"/kubepods/besteffort/pod{pod}/{cid}", record, **bundle)
    return Engine(pod, cid, record, path)


def drivers(cid: str, record: Path) -> dict[int, int]:
    """device -> host pid of the workers that recorded one (in-container pids mapped)."""
    by_ns = {container_pid(p): p for p in host_pids(cid)}
    return {device: by_ns[pid] for device, pid in records(record).items() if pid in by_ns}


def ranked(agent: Agent, cid: str, record: Path) -> dict[str, Any] | None:
    """The container's entry once both ranks are adopted, each worker's every
    thread on its rank's CPUs, and both workers have recorded their device."""
    docs = agent.containers()
    entry = next((d for d in docs or () if d["container_id"] == cid), None)
    doc = None if entry is None else entry.get("placement")
    if not doc or len(doc["ranks"]) != 2 or len(drivers(cid[:32], record)) != 2:
        return None
    for r in doc["ranks"]:
        if r["state"] != "running" or not r.get("adopted") or not r.get("pid"):
            return None
        if set(thread_cpus(r["pid"]).values()) != {format_cpulist(r["cpus"])}:
            return None
    return entry


@pytest.mark.usefixtures("runc_on_two_cpus")
def test_titled_workers_are_ranked_by_the_device_they_hold_open_in_their_container(
    tmp_path: Path,
) -> None:
    e = engine_bundle(tmp_path)
    pod, cid, record, bundle = e.pod, e.cid, e.record, e.bundle
    with kubelet_parents(pod), running(bundle, cid[:32], tmp_path / "runc.log"):
        # API server, engine core, two workers, and the spawn's resource tracker.
        poll(lambda: len(drivers(cid[:32], record)) == 2, 60, 0.5, what="both workers on a device")
        drives = drivers(cid[:32], record)
        titles = {device: title(pid) for device, pid in drives.items()}
        # The title says the other rank: TP0 drives nvidia1.
        assert titles == {0: "VLLM::Worker_TP1", 1: "VLLM::Worker_TP0"}, titles
        with agent_running(
            tmp_path / "agent", pods=[pod], base=BASE, prefix=PRIVATE_DEV_PREFIX
        ) as agent:
            entry = poll(lambda: ranked(agent, cid, record), 90, 0.5, what="both ranks placed")
            got = {r["rank"]: r["pid"] for r in entry["placement"]["ranks"]}
            assert got == drives, (got, drives, titles)  # the device won
            cpus = {r["rank"]: format_cpulist(r["cpus"]) for r in entry["placement"]["ranks"]}
            assert cpus == {0: "0", 1: "1"}, cpus
            # One conflict each, in the container's supervisor's log.
            logged = "".join(p.read_text() for p in (tmp_path / "agent/state").glob("*.log"))
            conflicts = [ln for ln in logged.splitlines() if "rank conflict" in ln]
            assert len(conflicts) == 2, logged[-3000:]
            assert all('action="device wins"' in ln for ln in conflicts), conflicts
        # The agent's SIGTERM left the engine running.
        assert len(drivers(cid[:32], record)) == 2


# -- the container's devices: only those its runtime gave it ---------------------------------

# Run as `unshare --mount --propagation private sh -c DRIVER_NS drv DIR CMD...`: a
# tmpfs over /proc/driver holding DIR's copy (a fixture host's nvidia/gpus/<bdf>/
# information files), private to the new mount namespace, so that the agent and
# its children see an NVIDIA driver with four GPUs, minors 0-3; the host's
# /proc/driver is not touched.
DRIVER_NS = (
    "set -eu; mount -t tmpfs -o mode=755 tmpfs /proc/driver; "
    'cp -a "$1"/. /proc/driver/; shift; exec "$@"'
)
GPUS = ("0000:1a:00.0", "0000:1b:00.0", "0000:9a:00.0", "0000:9b:00.0")
UUIDS = tuple(f"GPU-0000000{i}-aaaa-bbbb-cccc-00000000000{i}" for i in range(4))


def driver_prefix(tmp: Path) -> tuple[str, ...]:
    builder = FakeHost(tmp / "host").cpus(1, 2, 1)
    for bdf, gpu_uuid in zip(GPUS, UUIDS, strict=True):
        builder = builder.nvidia_gpu(bdf, 0, uuid=gpu_uuid)
    driver = builder.build() / "proc/driver"
    unshare = ("unshare", "--mount", "--propagation", "private")
    return (*unshare, "sh", "-c", DRIVER_NS, "drv", str(driver))


def reached(agent: Agent, cid: str) -> dict[str, Any] | None:
    """The container's entry once its child's plan is in and both ranks are adopted."""
    entry = next((d for d in agent.containers() or () if d["container_id"] == cid), None)
    doc = None if entry is None else entry.get("placement")
    if not doc or not doc.get("ranks"):
        return None
    if any(r["state"] != "running" or not r.get("adopted") for r in doc["ranks"]):
        return None
    return entry


@pytest.mark.usefixtures("runc_on_two_cpus")
def test_a_container_given_two_of_four_gpus_is_planned_on_those_two(tmp_path: Path) -> None:
    """The runtime made the host's minors 2 and 3 the container's nvidia0 and
    nvidia1 (renamed, as the NVIDIA toolkit's CDI specs may): the agent reads the
    nodes' numbers, its child plans GPUs 9a and 9b only, two ranks (not four with
    two waiting), and the workers are adopted by their titles (they open no
    device: there is no driver behind these numbers)."""
    nodes = [("/dev/nvidia0", 195, 2), ("/dev/nvidia1", 195, 3)]
    e = engine_bundle(tmp_path, nodes=nodes, open_device=False)
    pod, cid, record, bundle = e.pod, e.cid, e.record, e.bundle
    prefix = driver_prefix(tmp_path)
    with kubelet_parents(pod), running(bundle, cid[:32], tmp_path / "runc.log"):
        poll(lambda: len(records(record)) == 2, 60, 0.5, what="both workers up")
        with agent_running(tmp_path / "agent", pods=[pod], base=BASE, prefix=prefix) as agent:
            entry = poll(lambda: reached(agent, cid), 90, 0.5, what="the ranks placed")
            assert entry["devices"] == list(GPUS[2:]), entry
            ranks = entry["placement"]["ranks"]
            assert [r["device"]["bus_id"] for r in ranks] == list(GPUS[2:]), ranks
            by_title = {title(r["pid"]): r["rank"] for r in ranks}
            assert by_title == {"VLLM::Worker_TP0": 0, "VLLM::Worker_TP1": 1}, by_title
            logged = agent.log.read_text()
            assert f"devices={GPUS[2]},{GPUS[3]}" in logged, logged[-2000:]


@pytest.mark.usefixtures("runc_on_two_cpus")
def test_the_kubelets_allotment_is_planned_over_the_containers_device_nodes(
    tmp_path: Path,
) -> None:
    """A container with all four GPUs' nodes (as NVIDIA_VISIBLE_DEVICES=all gives a
    pod) that the device plugin allotted two: the agent asks the kubelet's Pod
    Resources API (a real gRPC server on a unix socket), matches the container by
    the names of the kubelet's log tree, resolves the UUIDs through the driver's
    information files, and its child plans those two. Without the kubelet's word
    the plan would have four ranks, two of them waiting."""
    nodes = [(f"/dev/nvidia{m}", 195, m) for m in range(4)]
    e = engine_bundle(tmp_path, nodes=nodes, open_device=False)
    pod, cid, record, bundle = e.pod, e.cid, e.record, e.bundle
    logs = tmp_path / "varlog"
    kubelet_link(logs, "vllm-0", "ml", pod, container="engine", cid=cid)
    grant = {"nvidia.com/gpu": [UUIDS[3], UUIDS[2]]}
    answer = list_answer([("ml", "vllm-0", [("engine", grant, [])])])
    with (
        pod_resources_server(tmp_path, lambda _request, _context: answer) as socket,
        kubelet_parents(pod),
        running(bundle, cid[:32], tmp_path / "runc.log"),
    ):
        poll(lambda: len(records(record)) == 2, 60, 0.5, what="both workers up")
        extra = ("--kube-logs", str(logs), "--pod-resources", socket)
        prefix = driver_prefix(tmp_path)
        with agent_running(
            tmp_path / "agent", pods=[pod], base=BASE, prefix=prefix, extra=extra
        ) as agent:
            entry = poll(lambda: reached(agent, cid), 90, 0.5, what="the ranks placed")
            assert entry["devices"] == list(GPUS[2:]), entry
            assert entry["devices_source"] == "pod-resources"
            allotted = entry["allotted"]["devices"]
            assert allotted == [
                {"resource": "nvidia.com/gpu", "ids": grant["nvidia.com/gpu"], "numa_nodes": []}
            ]
            ranks = entry["placement"]["ranks"]
            assert [r["device"]["bus_id"] for r in ranks] == list(GPUS[2:]), ranks
            logged = agent.log.read_text()
            assert "pod resources differ from device nodes" in logged, logged[-2000:]
            assert f"nodes={','.join(GPUS)}" in logged
