"""The node agent moves a runc container's adopted workers' memory to their ranks' nodes;
run INSIDE the test guest (as root, cgroup v2).

    tests/guest/run-in-vm --nodes 2 -- .venv/bin/python -u tests/vm_checks/agent_numa.py [RUN...]

Default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3. Each run starts a real `runc`
container in the kubelet's cgroupfs layout (`/kubepods/besteffort/pod<UID>/<ID>`,
allowed CPUs 0-3) holding a fake vLLM (`python3 .../bin/vllm serve m`) whose two
workers carry LOCAL_RANK=0/1. Before any supervisor exists each worker puts itself
on the CPUs of the *other* rank's node (rank r on node 1-r) and first-touches 64 MiB
of private anonymous memory there, so all of it starts remote. Then
`python -m supervisor agent` is started; its attach-mode child adopts the workers
(rank r planned on node r) and moves their pages (issue 26's migrate_pages).

RUN (default: all three, in one boot):
- `mems-all`: the container's cpuset.mems 0-1. Each worker's anonymous pages
  (numa_maps) reach >= 0.99 on its rank's node within 90 s, and the agent's
  /metrics `placement_local_memory_ratio{container,pod,rank}` agrees within 0.01.
- `mems-0`: cpuset.mems 0 (a memory manager's or an operator's narrowing). Every
  first touch lands on node 0 whatever the CPU. attach.md: a rank's node outside
  the engine's cgroup cpuset.mems is no memory node of its plan (rank 0 gets
  node 0, rank 1 none) and /placement warns why; rank 1's pages stay on node 0
  (migrate_pages(2) as root would move them out of the container's nodes: the
  kernel checks the caller's cpuset, not the target's), and no ratio is
  reported for it.
- `no-mempolicy`: the agent (and so its child) under a seccomp filter refusing the
  NUMA memory calls with EPERM, as a pod under the runtime's default profile without
  CAP_SYS_NICE: nothing can move the pages, rank 0's stay on node 1 (local ratio
  about 0), the child says why (`capabilities.mempolicy`) and the metric agrees.
  The same numa_maps count as `mems-all`, failing where no page was moved.

Prints "PASS name: detail" / "FAIL name: detail" (tests/agent/test_agent_numa_vm.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from supervisor.cpulist import parse_cpulist  # noqa: E402
from supervisor.toml_out import to_toml  # noqa: E402
from tests.support.children import thread_cpus  # noqa: E402
from tests.support.daemon_support import daemon_env, free_port, stop_process  # noqa: E402
from tests.support.oci import Profile, host_pids, make_bundle, running  # noqa: E402
from tests.support.poll import wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402
from tests.vm_checks.daemon_numa import anon_pages_by_node  # noqa: E402

CHECKS = Checklist()
RUNS = ("mems-all", "mems-0", "no-mempolicy")
WORKER_MIB = 64

# The container's main process: `vllm serve` as its console script runs it, two
# workers as its API server starts them (LOCAL_RANK each). Each worker's memory is
# all on the other rank's node before any supervisor exists: the kernel puts a page
# on the node of the CPU that first touches it (the default local policy), and the
# engine starts worker r on node 1-r's CPUs (a child inherits its parent's affinity,
# sched_setaffinity(2)), from its first instruction. No memory policy is set: the
# container's seccomp refuses it, as docker's default does without CAP_SYS_NICE.
ENGINE = """#!{python}
import os, subprocess, sys, time
def node_cpus(node):
    with open(f"/sys/devices/system/node/node{{node}}/cpulist") as f:
        low, _, high = f.read().strip().partition("-")
    return range(int(low), int(high or low) + 1)
mine = os.sched_getaffinity(0)
for rank in (0, 1):
    os.sched_setaffinity(0, node_cpus(1 - rank))
    env = dict(os.environ, LOCAL_RANK=str(rank))
    subprocess.Popen([sys.executable, os.environ["WORKER"], os.environ["OUT"]], env=env)
os.sched_setaffinity(0, mine)
time.sleep(3600)
"""
WORKER = f"""
import mmap, os, sys, threading, time
buf = mmap.mmap(-1, {WORKER_MIB} << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for at in range(0, len(buf), 4096):
    buf[at] = 1
open(os.path.join(sys.argv[1], "touched" + os.environ["LOCAL_RANK"]), "w").close()
threading.Thread(target=time.sleep, args=(3600,)).start()
time.sleep(3600)
"""
BASE = {
    "cpu_ranks": 2,
    "stop_timeout_s": 2,
    "workers": {"rank_from": ["env:LOCAL_RANK"]},
    "placement": {"rank_roles": {}, "on_shortage": "share"},
    "drift": {"check_interval_s": 0.5, "numa_maps_interval_s": 1},
}


def ratio_on(pid: int, node: int) -> tuple[float, dict[int, int]]:
    """The share of `pid`'s anonymous pages on `node`, and its pages per node."""
    by_node, _ = anon_pages_by_node(pid)
    total = sum(by_node.values())
    return (by_node.get(node, 0) / total if total else 0.0), by_node


def workers_by_rank(cid: str) -> dict[int, int]:
    """{LOCAL_RANK: host pid} of the container's workers."""
    out: dict[int, int] = {}
    for pid in host_pids(cid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for var in environ:
            if var.startswith(b"LOCAL_RANK="):
                out[int(var.split(b"=", 1)[1])] = pid
    return out


def get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return str(resp.read().decode())
    except OSError:
        return None


def metric_ratio(text: str, cid12: str, rank: int) -> float | None:
    """The agent's placement_local_memory_ratio for `rank` of container `cid12`."""
    for line in text.splitlines():
        if line.startswith("placement_local_memory_ratio{") and f'container="{cid12}"' in line:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if labels.get("rank") == str(rank):
                return float(line.rsplit(" ", 1)[1])
    return None


def adopted(url: str) -> dict[str, Any] | None:
    """The container's entry once its child runs and both workers are adopted."""
    text = get(f"{url}/placement")
    docs = json.loads(text)["containers"] if text else []
    if len(docs) != 1 or docs[0]["state"] != "running" or not docs[0]["placement"]:
        return None
    ranks = docs[0]["placement"]["ranks"]
    ok = len(ranks) == 2 and all(r["state"] == "running" and r["adopted"] for r in ranks)
    return docs[0] if ok else None


def scenario(run: str, tmp: Path) -> None:
    out = tmp / run
    out.mkdir()
    pod = str(uuid.uuid4())
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    short = cid[:32]  # runc's id; the cgroup holds the full one, as the kubelet's does
    # The real interpreter, not the venv's link to it: make_bundle binds its home.
    python = str(Path(sys.executable).resolve())
    script = out / "bin/vllm"
    script.parent.mkdir()
    script.write_text(ENGINE.format(python=python))
    script.chmod(0o755)
    (out / "worker.py").write_text(WORKER)
    spec = make_bundle(
        out / "bundle",
        [python, str(script), "serve", "m"],
        {"PATH": "/usr/bin:/bin", "WORKER": str(out / "worker.py"), "OUT": str(out)},
        cgroups_path=f"/kubepods/besteffort/pod{pod}/{cid}",
        cpus="0-3",
        profile=Profile(privileged=False),
        binds=[str(out)],
    )
    spec["linux"]["resources"]["cpu"]["mems"] = "0" if run == "mems-0" else "0-1"
    (out / "bundle/config.json").write_text(json.dumps(spec, indent=1))
    (out / "base.toml").write_text(to_toml(BASE))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = out / "agent.log"
    with running(out / "bundle", short, out / "runc.log"):
        touched = wait_until(lambda: all((out / f"touched{r}").exists() for r in (0, 1)), 120, 0.2)
        workers = workers_by_rank(short)
        if not CHECKS.check(
            f"{run} workers touched", bool(touched) and sorted(workers) == [0, 1], f"{workers}"
        ):
            return
        before = {r: ratio_on(pid, r) for r, pid in workers.items()}
        for r, (ratio, pages) in before.items():
            print(f"INFO {run} rank {r} before the agent: ratio on node {r} {ratio:.4f} {pages}")
        if run != "mems-0":  # under mems 0 every page is on node 0 whatever the CPU
            CHECKS.check(
                f"{run} memory remote before the agent",
                all(ratio < 0.05 for ratio, _ in before.values()),
                f"{ {r: round(v[0], 4) for r, v in before.items()} }",
            )
        prefix = (
            [sys.executable, f"{REPO}/tests/support/seccomp_exec.py", "memory", "--"]
            if run == "no-mempolicy"
            else []
        )
        with open(log, "wb") as err:
            agent = subprocess.Popen(
                [
                    *prefix,
                    *(sys.executable, "-m", "supervisor", "agent"),
                    *("--listen", f"127.0.0.1:{port}", "--interval-s", "1", "--pod", pod),
                    *("--base-config", str(out / "base.toml")),
                    *("--state-dir", str(out / "state")),
                ],
                cwd=REPO,
                env=daemon_env(PYTHONPATH=REPO),
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        try:
            mems = Path(f"/sys/fs/cgroup/kubepods/besteffort/pod{pod}/{cid}/cpuset.mems.effective")
            check_placed(
                run, url, cid=cid, workers=workers, before=before, mems=mems.read_text().strip()
            )
        finally:
            code = stop_process(agent, 60)  # SIGTERM: every child detaches, engines run on
            CHECKS.check(f"{run} agent stops", code == 0, f"rc {code}")
            if CHECKS.failed:
                print(f"--- {log} ---\n{log.read_text()[-3000:]}", flush=True)
                for child_log in (out / "state").glob("*.log"):
                    print(f"--- {child_log} ---\n{child_log.read_text()[-4000:]}", flush=True)


def check_placed(
    run: str,
    url: str,
    *,
    cid: str,
    workers: dict[int, int],
    before: dict[int, tuple[float, dict[int, int]]],
    mems: str,
) -> None:
    entry = wait_until(lambda: adopted(url), 180, 0.5)
    if not CHECKS.check(f"{run} adopted", entry is not None, "both workers adopted"):
        return
    ranks = {r["rank"]: r for r in entry["placement"]["ranks"]}
    # Under cpuset.mems 0 rank 1's node is none of the container's: no memory node.
    want = {0: [0], 1: []} if run == "mems-0" else {0: [0], 1: [1]}
    CHECKS.check(
        f"{run} rank r planned on node r",
        all(ranks[r]["mems"] == want[r] and ranks[r]["pid"] == workers[r] for r in (0, 1)),
        "; ".join(f"rank {r} pid {ranks[r]['pid']} mems {ranks[r]['mems']}" for r in (0, 1)),
    )
    placed = (0,) if run == "mems-0" else (0, 1)  # the ranks with a memory node
    for r, pid in sorted(workers.items()):
        planned = parse_cpulist(",".join(str(c) for c in ranks[r]["cpus"]))
        cpus = set(thread_cpus(pid).values())
        CHECKS.check(
            f"{run} rank {r} threads on its CPUs",
            all(parse_cpulist(c) <= planned for c in cpus),
            f"threads {sorted(cpus)} planned {sorted(planned)}",
        )
    if run != "no-mempolicy":
        # The adoption moves the pages at once; the check loop moves what is left.
        wait_until(lambda: all(ratio_on(workers[r], r)[0] >= 0.99 for r in placed), 90, 0.5)

    def agrees() -> bool:
        text = get(f"{url}/metrics") or ""
        got = {r: metric_ratio(text, cid[:12], r) for r in (0, 1)}
        return all(
            m is not None and abs(m - ratio_on(workers[r], r)[0]) <= 0.01
            for r, m in got.items()
            if r in placed
        ) and all(got[r] is None for r in (0, 1) if r not in placed)

    # Also the wait that lets the no-mempolicy child read numa_maps and try its moves.
    ok = wait_until(agrees, 30, 0.5)
    text = get(f"{url}/metrics") or ""
    CHECKS.check(
        f"{run} metric agrees with numa_maps",
        bool(ok),
        "; ".join(
            f"rank {r} metric {metric_ratio(text, cid[:12], r)} numa_maps {ratio_on(p, r)[0]:.4f}"
            for r, p in sorted(workers.items())
        ),
    )
    for r, pid in sorted(workers.items()):
        ratio, pages = ratio_on(pid, r)
        detail = f"before {before[r][0]:.4f} {before[r][1]} after {ratio:.4f} {pages}"
        print(f"INFO {run} rank {r} after: {detail}", flush=True)
        if run == "mems-all":
            CHECKS.check(f"{run} rank {r} pages on node {r}", ratio >= 0.99, detail)
        elif run == "no-mempolicy":  # they all started remote and nothing may move them
            CHECKS.check(f"{run} rank {r} pages left remote", ratio < 0.05, detail)
        elif r == 1:
            # The kernel would let a root supervisor move them to node 1 (it checks
            # the caller's cpuset, mm/mempolicy.c kernel_migrate_pages); the plan
            # keeps the rank within the container's nodes, so they stay on node 0.
            CHECKS.check(
                f"{run} rank 1 pages left within cpuset.mems",
                mems == "0" and ratio < 0.05,
                f"container cpuset.mems.effective {mems}; {detail}",
            )
    if run == "mems-0":
        said = json.dumps(entry["placement"])
        CHECKS.check(
            f"{run} says why",
            "outside the engine's cgroup cpuset.mems" in said,
            said[:600] if "outside" not in said else said[said.index("outside") - 200 :][:600],
        )
    if run == "no-mempolicy":
        mempolicy = entry["placement"]["supervisor"]["capabilities"].get("mempolicy") or {}
        CHECKS.check(
            f"{run} says why",
            mempolicy.get("available") is False and bool(mempolicy.get("reason")),
            f"capabilities.mempolicy {mempolicy}",
        )


def main() -> int:
    if os.environ.get("PS_GUEST") != "1":
        print("run me inside the test guest (tests/guest/run-in-vm)", file=sys.stderr)
        return 2
    runs = sys.argv[1:] or list(RUNS)
    tmp = Path(tempfile.mkdtemp())
    for run in runs:
        try:
            scenario(run, tmp)
        except Exception as exc:  # one run's failure is its FAIL, the next run still runs
            CHECKS.check(f"{run} ran", False, repr(exc)[-1500:])
    return CHECKS.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
