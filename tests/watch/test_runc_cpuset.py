"""The daemon in a real OCI container (runc, cgroup v1): its owner's cpuset updates.

`runc spec` makes the config, edited: the root is an empty dir with bind
mounts of this host's /usr, /lib*, /bin, /sbin, /etc, the Python install,
the checkout (with its .venv) and /tmp; the host's /sys (with
/sys/fs/cgroup, rw) and network and pid namespaces are shared, so the test
reads the ranks' threads in /proc and the API on 127.0.0.1. The container
gets `linux.resources.cpu.cpus = "0-1"` under its own cgroupsPath. Then, as
a runtime does: `runc update --cpuset-cpus 1` (one plain write of the
container's cpuset) must succeed and every thread of every rank be on CPU 1
(kernel and daemon) with the plan following, `runc update --cpuset-cpus 0-1`
must bring the ranks back to their own CPUs, over several rounds (p50/p99
printed), and `runc kill ID TERM` stops it cleanly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.cpulist import format_cpulist
from tests.support.children import COMM_THREADS_WORKER, thread_cpus
from tests.support.daemon_support import (
    REPO,
    free_port,
    get_json,
    rank_pids,
    thread_cpus_as_planned,
    write_cpuset_config,
)
from tests.support.oci import daemon_process, runc, running
from tests.support.poll import poll

pytestmark = pytest.mark.root
ROUNDS = 8
# Capability numbers (capabilities(7)); only those this process holds can be granted.
CAPS = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_DAC_READ_SEARCH": 2,
    "CAP_FOWNER": 3,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_NET_ADMIN": 12,
    "CAP_IPC_LOCK": 14,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
    "CAP_SYS_NICE": 23,
    "CAP_SYS_RESOURCE": 24,
    "CAP_AUDIT_WRITE": 29,
}


def held_caps() -> list[str]:
    status = Path("/proc/self/status").read_text()
    bounding = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("CapBnd")), 16)
    return [name for name, bit in CAPS.items() if bounding >> bit & 1]


def make_bundle(bundle: Path, args: list[str], env: dict[str, str], cgroups_path: str) -> None:
    rootfs = bundle / "rootfs"
    rootfs.mkdir(parents=True)
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, timeout=30)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"] = {"path": str(rootfs), "readonly": False}
    proc = spec["process"]
    proc.update(terminal=False, args=args, cwd=str(REPO))
    proc["env"] = [f"{k}={v}" for k, v in env.items()]
    proc["capabilities"] = {k: held_caps() for k in ("bounding", "effective", "permitted")}
    binds = ["/usr", "/bin", "/sbin", "/etc", "/tmp", str(REPO), sys.base_prefix]
    binds += [p for p in ("/lib", "/lib32", "/lib64", "/libx32") if os.path.isdir(p)]
    venv_python = Path(sys.executable).resolve().parent.parent
    binds.append(str(venv_python))
    mounts = [m for m in spec["mounts"] if m["destination"] in ("/proc", "/dev", "/dev/pts")]
    mounts.append({"destination": "/sys", "type": "bind", "source": "/sys", "options": ["rbind"]})
    for path in dict.fromkeys(binds):
        mounts.append({"destination": path, "type": "bind", "source": path, "options": ["rbind"]})
    spec["mounts"] = mounts
    linux = spec["linux"]
    # Host pid and network namespaces (the test reads /proc and the API), no
    # cgroup namespace (the daemon sees its host cgroup paths under /sys/fs/cgroup).
    linux["namespaces"] = [n for n in linux["namespaces"] if n["type"] in ("mount", "ipc", "uts")]
    linux.pop("maskedPaths", None)
    linux.pop("readonlyPaths", None)
    linux["cgroupsPath"] = cgroups_path
    linux["resources"] = {"cpu": {"cpus": "0-1", "mems": "0"}}
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))


@contextlib.contextmanager
def container(tmp_path: Path) -> Iterator[tuple[str, int, Path]]:
    """The daemon in a runc container; (id, API port, log). Killed and deleted afterwards."""
    worker = tmp_path / "worker.py"
    worker.write_text(COMM_THREADS_WORKER)
    config = write_cpuset_config(tmp_path, ranks=2, threads=2, interval_s=0.2, worker=worker)
    port = free_port()
    cid = f"ps-runc-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    args, env = daemon_process(config, cid, port)
    bundle = tmp_path / "bundle"
    make_bundle(bundle, args, env, f"/{cid}")
    log = tmp_path / "daemon.log"
    try:
        with running(bundle, cid, log):
            yield cid, port, log
    finally:
        for hierarchy in ("cpuset", "memory"):
            with contextlib.suppress(OSError):
                shutil.rmtree(f"/sys/fs/cgroup/{hierarchy}/{cid}", ignore_errors=True)


def placement(port: int) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = get_json(f"http://127.0.0.1:{port}/placement")
        return doc
    except OSError:
        return None


def all_threads_on(pids: dict[int, int], cpus: str) -> bool:
    for pid in pids.values():
        threads = thread_cpus(pid)
        if not threads or set(threads.values()) != {cpus}:
            return False
    return True


def plan_is(port: int, cpus: list[list[int]]) -> bool:
    doc = placement(port)
    return doc is not None and [r["cpus"] for r in doc["ranks"]] == cpus


def timed(predicate: Any, timeout_s: float) -> float:
    """Seconds until `predicate()` held (polled every 2 ms); fails at the deadline."""
    start = time.perf_counter()
    poll(predicate, timeout_s, 0.002, what=str(predicate))
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank quantile (with 8 rounds, p99 is the slowest)."""
    return sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))]


@pytest.mark.timeout(300)
def test_runc_update_shrinks_and_grows_the_daemon_s_cpuset(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("runc") is None:
        pytest.skip("needs root and runc (.ci/setup installs it)")
    if not os.path.isdir("/sys/fs/cgroup/cpuset") or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs a cgroup v1 cpuset hierarchy and CPUs 0-1")
    with container(tmp_path) as (cid, port, log):
        doc = poll(
            lambda: (d := placement(port)) and len(rank_pids(d)) == 2 and d,
            60,
            what=f"both ranks running in the container:\n{log.read_text()[-3000:]}",
        )
        pids = rank_pids(doc)
        assert [r["cpus"] for r in doc["ranks"]] == [[0], [1]], doc["ranks"]
        poll(lambda: thread_cpus_as_planned(placement(port) or {}, {0: "0", 1: "1"}), 20)
        threads_s: list[float] = []
        plan_s: list[float] = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            shrink = runc("update", "--cpuset-cpus", "1", cid, check=False)
            assert shrink.returncode == 0, shrink.stderr  # v1 EBUSY before
            poll(lambda: all_threads_on(pids, "1"), 5, 0.002, what="every thread on CPU 1")
            threads_s.append(time.perf_counter() - start)
            poll(lambda: plan_is(port, [[1], [1]]), 5, 0.002, what="the plan on CPU 1")
            plan_s.append(time.perf_counter() - start)
            assert format_cpulist(os.sched_getaffinity(pids[0])) == "1"

            grow = runc("update", "--cpuset-cpus", "0-1", cid, check=False)
            assert grow.returncode == 0, grow.stderr
            poll(
                lambda: thread_cpus_as_planned(placement(port) or {}, {0: "0", 1: "1"}),
                10,
                what="ranks back on their own CPUs after the grow",
            )
        own = Path(f"/sys/fs/cgroup/cpuset/{cid}")
        assert not [d for d in own.iterdir() if d.is_dir()], "child cpusets block the owner"
        doc = placement(port) or {}
        assert rank_pids(doc) == pids  # followed, never restarted
        assert doc["supervisor"]["cpuset_changes"] == 2 * ROUNDS
        print(
            f"\nrunc update shrink, {ROUNDS} rounds: every rank thread on CPU 1 "
            f"p50={statistics.median(threads_s) * 1e3:.1f}ms "
            f"p99={percentile(threads_s, 0.99) * 1e3:.1f}ms; "
            f"plan followed p50={statistics.median(plan_s) * 1e3:.1f}ms "
            f"p99={percentile(plan_s, 0.99) * 1e3:.1f}ms (from the start of `runc update`)"
        )
        stopped = runc("kill", cid, "TERM", check=False)
        assert stopped.returncode == 0, stopped.stderr
        poll(
            lambda: json.loads(runc("state", cid).stdout)["status"] == "stopped",
            30,
            what="container stopped after TERM",
        )
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        inst = Path(f"/sys/fs/cgroup/memory/{cid}/placement-supervisor-{cid}")
        assert not inst.exists(), "a clean stop removes the instance's cgroups"
        for pid in pids.values():
            assert not Path(f"/proc/{pid}").exists() or "zombie" in thread_state(pid)


def thread_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"
