"""Containers found from /proc and the cgroup tree (supervisor.agent.containers).

The layouts are the paths the kubelet and the runtimes make; the fixture node
has two pods (cgroup v1 cgroupfs, cgroup2 systemd), a host service and a
process in a cgroup its container made below its own; a real `runc`
container, started in the kubelet's cgroupfs layout, is found by the CLI as
a node agent would find it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from supervisor.agent.containers import container_of, container_of_lines, find_containers
from supervisor.engines.engine_kind import recognise_kind
from supervisor.hostfs import HostFS
from supervisor.topology.cgroup import parse_proc_cgroup
from tests.support.daemon_support import REPO
from tests.support.oci import Profile, host_pids, kubelet_parents, make_bundle, running
from tests.support.poll import poll

POD = "0f2d8a9e-5b1c-4c7e-9f00-1234567890ab"
CID = "4b825dc642cb6eb9a060e54bf8d69288fbee4904" + "0" * 24  # 64 hex digits
CID2 = "a" * 64


@pytest.mark.parametrize(
    ("path", "cgroup", "layout", "pod", "qos"),
    [
        (f"/kubepods/burstable/pod{POD}/{CID}", None, "kubelet-cgroupfs", POD, "burstable"),
        (f"/kubepods/besteffort/pod{POD}/{CID}", None, "kubelet-cgroupfs", POD, "besteffort"),
        (f"/kubepods/pod{POD}/{CID}", None, "kubelet-cgroupfs", POD, None),  # guaranteed
        (
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope",
            None,
            "kubelet-systemd",
            POD,
            "burstable",
        ),
        (
            f"/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/crio-{CID}.scope",
            None,
            "kubelet-systemd",
            POD,
            None,
        ),
        (f"/system.slice/docker-{CID}.scope", None, "docker-systemd", None, None),
        (f"/docker/{CID}", None, "docker-cgroupfs", None, None),
        (f"/machine.slice/libpod-{CID}.scope", None, "podman", None, None),
        # A cgroup the container made below its own (cgroup namespace): still its.
        (
            f"/kubepods/pod{POD}/{CID}/init.scope",
            f"/kubepods/pod{POD}/{CID}",
            "kubelet-cgroupfs",
            POD,
            None,
        ),
    ],
)
def test_each_runtime_s_layout_names_its_container(
    path: str, cgroup: str | None, layout: str, pod: str | None, qos: str | None
) -> None:
    ref = container_of(path)
    assert ref is not None
    assert (ref.cgroup, ref.container_id, ref.layout) == (cgroup or path, CID, layout)
    assert (ref.pod_uid, ref.qos) == (pod, qos)


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/system.slice/sshd.service",
        "/user.slice/user-0.slice/session-3.scope",
        "/kubepods/burstable",  # a QoS parent
        f"/kubepods/burstable/pod{POD}",  # the pod's own cgroup: no container
        "/docker/not-an-id",
        f"/elsewhere/kubepods/pod{POD}/{CID}",  # not from the root
    ],
)
def test_paths_of_no_container(path: str) -> None:
    assert container_of(path) is None


def test_an_operator_s_cgroup_root_makes_each_child_a_container() -> None:
    ref = container_of("/runners/engine-a/sub", extra_roots=("/runners",))
    assert ref is not None and (ref.cgroup, ref.container_id, ref.layout) == (
        "/runners/engine-a",
        "engine-a",
        "extra",
    )
    assert container_of("/runners", extra_roots=("/runners/",)) is None


def test_a_hybrid_host_s_cgroup2_line_at_the_parent_does_not_hide_the_container() -> None:
    lines = parse_proc_cgroup(
        f"12:memory:/kubepods/pod{POD}/{CID}\n3:cpuset:/kubepods/pod{POD}/{CID}\n0::/user.slice\n"
    )
    ref = container_of_lines(lines)
    assert ref is not None and ref.container_id == CID


def test_an_engine_run_by_its_console_script_is_recognised() -> None:
    """`vllm serve` as /proc shows it: the interpreter, then the script's path."""
    assert (
        recognise_kind(["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "m", "--tp", "2"])
        == "vllm"
    )
    torchrun = ["python3.12", "-u", "/opt/venv/bin/torchrun", "--nproc", "8", "t.py"]
    assert recognise_kind(torchrun) == "torchrun"
    assert recognise_kind(["python3", "/opt/app/serve.py"]) == "custom"
    assert recognise_kind(["python3", "-c", "import", "vllm"]) == "custom"


# -- a fixture node -----------------------------------------------------------------------------


def _proc(
    root: Path,
    pid: int,
    ppid: int,
    cgroup: str,
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    start: int = 1000,
) -> None:
    d = root / f"proc/{pid}"
    d.mkdir(parents=True)
    comm = os.path.basename(argv[0])[:15]
    # proc(5): state, ppid, pgrp, session, fields 7-13, utime, stime, 16-21, starttime (22).
    fields = ["S", str(ppid), str(pid), str(pid), *["0"] * 7, "0", "0", *["0"] * 6, str(start)]
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)} 0 0\n")
    (d / "cgroup").write_text(cgroup)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in (env or {}).items()))
    (d / "fd").mkdir()


def test_a_fixture_node_s_containers_with_their_cpus_devices_and_kind(tmp_path: Path) -> None:
    v1_path = f"/kubepods/burstable/pod{POD}/{CID}"
    pod2 = POD.replace("0f2d", "1111")
    v2_path = (
        f"/kubepods.slice/kubepods-pod{pod2.replace('-', '_')}.slice/cri-containerd-{CID2}.scope"
    )
    v1 = f"4:memory:{v1_path}\n3:cpuset:{v1_path}\n0::/\n"
    v2 = f"0::{v2_path}\n"
    # Pod 1 (v1 cgroupfs): containerd's shim (outside), the engine, two workers.
    _proc(tmp_path, 90, 1, "3:cpuset:/\n0::/system.slice/containerd.service\n", ["shim"])
    engine = ["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "m", "-tp", "2"]
    _proc(
        tmp_path, 100, 90, v1, engine, env={"CUDA_VISIBLE_DEVICES": "2,3", "HOME": "/"}, start=500
    )
    _proc(tmp_path, 101, 100, v1, ["python3", "-c", "worker"], start=600)
    _proc(tmp_path, 102, 100, v1, ["python3", "-c", "worker"], start=601)
    # Pod 2 (cgroup2, systemd driver): torchrun and a process in a sub-cgroup of its own.
    _proc(tmp_path, 200, 90, v2, ["torchrun", "--nproc-per-node", "2", "t.py"], start=700)
    _proc(tmp_path, 201, 200, f"0::{v2_path}/inner\n", ["python3", "t.py"], start=701)
    # A host service: no container.
    _proc(tmp_path, 300, 1, "0::/system.slice/sshd.service\n", ["sshd"])
    # The cpusets, as the kubelet wrote them (v1) and the kernel shows them (v2).
    cs1 = tmp_path / f"sys/fs/cgroup/cpuset{v1_path}"
    cs1.mkdir(parents=True)
    (cs1 / "cpuset.effective_cpus").write_text("4-7\n")
    (cs1 / "cpuset.effective_mems").write_text("0\n")
    (tmp_path / "sys/fs/cgroup/cgroup.controllers").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset cpu memory\n")
    cs2 = tmp_path / f"sys/fs/cgroup{v2_path}"
    cs2.mkdir(parents=True)
    (cs2 / "cpuset.cpus.effective").write_text("8-15\n")
    (cs2 / "cpuset.mems.effective").write_text("1\n")
    # Worker 101 holds a device open whose number the kernel links to a PCI
    # function (here /dev/null's 1:3, linked as an accelerator's node would be).
    (tmp_path / "proc/101/fd/5").symlink_to("/dev/null")
    chars = tmp_path / "sys/dev/char"
    chars.mkdir(parents=True)
    (chars / "1:3").symlink_to("../../devices/pci0000:80/0000:80:00.0/0000:81:00.0/davinci2")

    found = find_containers(HostFS(str(tmp_path)))
    assert [c.ref.container_id for c in found] == [CID2, CID]  # in cgroup-path order
    torch, vllm = found
    assert (vllm.main.pid, vllm.main.start_time, vllm.pids) == (100, 500, (100, 101, 102))
    assert (vllm.kind, vllm.ref.pod_uid, vllm.ref.qos) == ("vllm", POD, "burstable")
    assert dict(vllm.visible) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert (vllm.cpus, vllm.mems) == (frozenset(range(4, 8)), frozenset({0}))
    assert vllm.devices == ("0000:81:00.0",)
    assert (torch.main.pid, torch.pids, torch.kind) == (200, (200, 201), "torchrun")
    assert (torch.cpus, torch.mems, torch.devices) == (frozenset(range(8, 16)), frozenset({1}), ())
    doc = vllm.to_doc()
    assert (doc["cpus"], doc["mems"], doc["pid"], doc["start_time"]) == ("4-7", "0", 100, 500)
    # The node agent's walk leaves the open files unread; the rest is the same.
    bare = find_containers(HostFS(str(tmp_path)), devices=False)
    assert [c.devices for c in bare] == [(), ()]
    assert [dataclasses.replace(c, devices=()) for c in found] == bare


def test_nothing_on_a_node_without_containers(tmp_path: Path) -> None:
    _proc(tmp_path, 1, 0, "0::/init.scope\n", ["systemd"])
    assert find_containers(HostFS(str(tmp_path))) == []


# -- a real container -----------------------------------------------------------------------------

FAKE_VLLM = """#!{python}
import subprocess, sys, time
# A worker, as vLLM's API server spawns its engine core.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(600)
"""


def _venv_outside_checkout() -> list[str]:
    """The venv, to bind into the container, when it is not under the checkout (a worktree)."""
    venv = Path(sys.executable).parent.parent
    return [] if venv.is_relative_to(REPO) else [str(venv)]


@pytest.mark.usefixtures("need_root")
def test_a_runc_container_in_the_kubelet_s_layout_is_found(tmp_path: Path) -> None:
    """runc makes the container's cgroup where the kubelet would (cgroupfs
    driver); the CLI, as a node agent, finds it with its pod, its processes,
    the kind its command line names and the CPUs runc gave it."""
    if subprocess.run(["which", "runc"], capture_output=True, check=False).returncode:
        pytest.skip("runc is not installed (.ci/setup installs it)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to give the container one")
    pod = str(uuid.uuid4())
    cid = uuid.uuid4().hex + uuid.uuid4().hex  # 64 hex digits, as runtimes name them
    cgroups_path = f"/kubepods/besteffort/pod{pod}/{cid}"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "vllm"
    script.write_text(FAKE_VLLM.format(python=sys.executable))
    script.chmod(0o755)
    bundle = tmp_path / "bundle"
    cpu = str(max(os.sched_getaffinity(0)))
    make_bundle(
        bundle,
        [sys.executable, str(script), "serve", "facebook/opt-125m"],
        {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "0"},
        cgroups_path=cgroups_path,
        cpus=cpu,
        profile=Profile(privileged=False),
        binds=[str(tmp_path), *_venv_outside_checkout()],
    )
    # runc removes the container's own cgroup; the kubelet-style parents are ours.
    with kubelet_parents(pod), running(bundle, cid[:32], tmp_path / "runc.log"):
        poll(lambda: len(host_pids(cid[:32])) == 2, 30, what="the engine and its worker")
        proc = subprocess.run(
            [sys.executable, "-m", "supervisor", "containers", "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=True,
            timeout=60,
        )
        docs = [d for d in json.loads(proc.stdout)["containers"] if d["container_id"] == cid]
        assert len(docs) == 1, proc.stdout
        doc = docs[0]
        pids = sorted(host_pids(cid[:32]))
        assert sorted(doc["pids"]) == pids
        assert (doc["layout"], doc["pod_uid"], doc["qos"]) == (
            "kubelet-cgroupfs",
            pod,
            "besteffort",
        )
        assert (doc["kind"], doc["cpus"], doc["cgroup"]) == ("vllm", cpu, cgroups_path)
        assert doc["visible"] == {"CUDA_VISIBLE_DEVICES": "0"}
        text = subprocess.run(
            [sys.executable, "-m", "supervisor", "containers"],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=True,
            timeout=60,
        ).stdout
        assert f"{cid[:12]} kubelet-cgroupfs pod {pod} pid {doc['pid']} kind vllm" in text
