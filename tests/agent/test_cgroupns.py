"""The node agent inside a cgroup namespace, and containers it may only partly read.

A real process in a private cgroup namespace (`unshare --cgroup`, as
containerd and CRI-O start a pod on cgroup v2) sees another container's
cgroup as `/../../kubepods/...`; `supervisor containers` run there must still
name the container, its pod and its cpuset, on this host's hybrid layout
(cgroup2 at /sys/fs/cgroup/unified, the v1 cpuset beside it). A container
whose main process belongs to another user, read without the capabilities
that open its environ and fds (capsh drops them), is listed with a reason
instead of failing the whole listing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from supervisor.topology.cgroup import parse_proc_cgroup
from supervisor.topology.cgroupns import NamespaceRoot, join_host_path, resolve_lines, up_count
from tests.support.daemon_support import REPO

UNIFIED = Path("/sys/fs/cgroup/unified")
CPUSET = Path("/sys/fs/cgroup/cpuset")


@pytest.mark.parametrize(
    ("root", "count"), [("/", 0), ("/../../..", 3), ("/..", 1), ("/a", None), ("/../a", None)]
)
def test_a_mount_root_of_dots_names_the_namespace_depth(root: str, count: int | None) -> None:
    assert up_count(root) == count


def test_paths_relative_to_the_namespace_root_become_host_paths() -> None:
    root = "/kubepods.slice/kubepods-podA.slice/cri-containerd-a.scope"
    other = "/../../kubepods-burstable.slice/kubepods-burstable-podB.slice/cri-containerd-b.scope"
    assert join_host_path(root, other) == (
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podB.slice/"
        "cri-containerd-b.scope"
    )
    assert join_host_path(root, "/") == root
    assert join_host_path("/a", "/../../x") is None  # above the host's root: not a host path
    lines = parse_proc_cgroup("3:cpuset:/../x\n1:cpu:/../y\n0::/../z\n")
    roots = {("cpuset",): NamespaceRoot("/p/q", ""), (): NamespaceRoot("/r", "")}
    assert [ln.path for ln in resolve_lines(lines, roots)] == ["/p/x", "/../y", "/z"]


# -- real namespaces -----------------------------------------------------------------------


def _hybrid() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (cgroups)")
    if not (UNIFIED / "cgroup.procs").exists() or not (CPUSET / "cpuset.cpus").exists():
        pytest.skip("needs the hybrid layout: cgroup2 at /sys/fs/cgroup/unified and v1 cpuset")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")


@contextmanager
def _cgroups(rel: str, cpus: str | None = None) -> Iterator[tuple[Path, Path]]:
    """`rel` made in cgroup2 and in the v1 cpuset hierarchy (each new dir given the
    root's CPUs and nodes, the leaf `cpus`); every dir made here removed after."""
    made: list[Path] = []
    for top in (UNIFIED, CPUSET):
        d = top
        for part in rel.strip("/").split("/"):
            d = d / part
            if not d.exists():
                d.mkdir()
                made.append(d)
                if top == CPUSET:
                    (d / "cpuset.cpus").write_text((CPUSET / "cpuset.cpus").read_text())
                    (d / "cpuset.mems").write_text((CPUSET / "cpuset.mems").read_text())
    if cpus is not None:
        (CPUSET / rel.strip("/") / "cpuset.cpus").write_text(cpus)
    try:
        yield UNIFIED / rel.strip("/"), CPUSET / rel.strip("/")
    finally:
        for d in reversed(made):
            # Another run's cgroup below a shared parent (/kubepods): theirs to remove.
            with contextlib.suppress(OSError):
                d.rmdir()


def _move(pid: int, dirs: tuple[Path, Path]) -> None:
    for d in dirs:
        (d / "cgroup.procs").write_text(str(pid))


def _in_namespace(agent: tuple[Path, Path], command: str) -> subprocess.CompletedProcess[str]:
    """`command` run by a shell moved into `agent`'s cgroups, then unshared into a
    cgroup namespace rooted there (what a pod's container is on cgroup v2)."""
    unified, cpuset = agent
    script = (
        f"echo $$ > {unified}/cgroup.procs && echo $$ > {cpuset}/cgroup.procs && "
        f"exec unshare --cgroup sh -c {_quote(command)}"
    )
    return subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60, check=False
    )


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def test_a_container_is_found_from_inside_a_private_cgroup_namespace() -> None:
    _hybrid()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to give the container one")
    pod = str(uuid.uuid4())
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    tag = uuid.uuid4().hex[:8]
    cpu = str(max(os.sched_getaffinity(0)))
    ctr_rel = f"kubepods/besteffort/pod{pod}/{cid}"
    with (
        _cgroups(f"robust-ns-{tag}/agentpod") as agent,
        _cgroups(ctr_rel, cpus=cpu) as ctr,
    ):
        engine = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "0"},
        )
        try:
            _move(engine.pid, ctr)
            # The namespace is real: the container's path climbs out of it.
            raw = _in_namespace(agent, f"cat /proc/{engine.pid}/cgroup")
            assert f"0::/../../{ctr_rel}" in raw.stdout, raw
            assert f":cpuset:/../../{ctr_rel}" in raw.stdout, raw
            proc = _in_namespace(agent, f"exec {sys.executable} -m supervisor containers --json")
            assert proc.returncode == 0, proc.stderr
            docs = [d for d in json.loads(proc.stdout)["containers"] if d["container_id"] == cid]
            assert len(docs) == 1, proc.stdout
            doc = docs[0]
            assert (doc["layout"], doc["pod_uid"], doc["qos"]) == (
                "kubelet-cgroupfs",
                pod,
                "besteffort",
            )
            assert (doc["cgroup"], doc["pid"], doc["cpus"]) == (f"/{ctr_rel}", engine.pid, cpu)
            assert doc["visible"] == {"CUDA_VISIBLE_DEVICES": "0"}
        finally:
            engine.kill()
            engine.wait()


def test_another_user_s_container_read_without_ptrace_is_listed_with_a_reason() -> None:
    _hybrid()
    if shutil.which("capsh") is None or shutil.which("setpriv") is None:
        pytest.skip("needs capsh (libcap) and setpriv (util-linux)")
    pod = str(uuid.uuid4())
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    with _cgroups(f"kubepods/besteffort/pod{pod}/{cid}") as ctr:
        # A process of `nobody`: root reads its environ and fds only by CAP_SYS_PTRACE.
        engine = subprocess.Popen(
            [
                *("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"),
                *(sys.executable, "-c", "import time; time.sleep(600)"),
            ],
            env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "1"},
        )
        try:
            _move(engine.pid, ctr)
            command = f"exec {sys.executable} -m supervisor containers --json"
            # environ is mode 0400 and fd/ 0500 of the owner, then ptrace-checked
            # (proc(5)): root opens them by CAP_DAC_OVERRIDE or CAP_DAC_READ_SEARCH
            # as well as CAP_SYS_PTRACE, so all three go to get EACCES.
            drop = "--drop=cap_sys_ptrace,cap_dac_override,cap_dac_read_search"
            proc = subprocess.run(
                ["capsh", drop, "--", "-c", command],
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=60,
                check=False,
            )
            assert proc.returncode == 0, proc.stderr
            docs = [d for d in json.loads(proc.stdout)["containers"] if d["container_id"] == cid]
            assert len(docs) == 1, proc.stdout
            doc = docs[0]
            assert (doc["pod_uid"], doc["pid"], doc["kind"]) == (pod, engine.pid, "custom")
            assert doc["visible"] == {}
            assert doc["reason"].startswith(f"environ of pid {engine.pid}: "), doc
            assert "EACCES" in doc["reason"] and f"fds of pid {engine.pid}" in doc["reason"], doc
        finally:
            engine.kill()
            engine.wait()


FIND = """
import json, sys
from supervisor.config_sections import AttachTarget
from supervisor.hostfs import HostFS
from supervisor.trees.attach import engine_cgroup_lines
from supervisor.trees.find_engine import find_engine
fs = HostFS("/")
by_cgroup = find_engine(fs, AttachTarget("cgroup", sys.argv[1]), 0)
by_match = AttachTarget("match", sys.argv[2])
lines = engine_cgroup_lines(fs, by_match, 0)
print(json.dumps({
    "pid": None if by_cgroup is None else by_cgroup.pid,
    "cgroup": None if by_cgroup is None else by_cgroup.cgroup,
    "lines": {",".join(line.controllers): line.path for line in lines or ()},
}))
"""


def test_attach_mode_finds_its_engine_by_host_path_from_inside_a_cgroup_namespace(
    tmp_path: Path,
) -> None:
    """A node agent's child (attach mode, in the agent's pod) is given the
    container's host cgroup path; from inside a private cgroup namespace the
    engine's /proc/<pid>/cgroup climbs out of it ("/../.."), and the finder and
    the cpuset lookup read it as the host path all the same."""
    _hybrid()
    pod = str(uuid.uuid4())
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    tag = uuid.uuid4().hex[:8]
    ctr_rel = f"kubepods/besteffort/pod{pod}/{cid}"
    (tmp_path / "find.py").write_text(FIND)
    with _cgroups(f"robust-ns-{tag}/agentpod") as agent, _cgroups(ctr_rel) as ctr:
        engine = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(600) # {tag}"])
        try:
            _move(engine.pid, ctr)
            proc = _in_namespace(
                agent, f"exec {sys.executable} {tmp_path}/find.py /{ctr_rel} 'sleep(600) # {tag}'"
            )
            assert proc.returncode == 0, proc.stderr
            doc = json.loads(proc.stdout)
            assert (doc["pid"], doc["cgroup"]) == (engine.pid, f"/{ctr_rel}"), doc
            # The hierarchies the test moved it in (the others: the root, as the agent's)
            assert doc["lines"][""] == doc["lines"]["cpuset"] == f"/{ctr_rel}", doc
        finally:
            engine.kill()
            engine.wait()
