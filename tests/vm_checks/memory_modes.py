"""Worker memory on its rank's node in one deployment mode; run INSIDE the test guest (root).

    tests/guest/run-in-vm --nodes 2 [--cgroup v1] -- \
        .venv/bin/python -u tests/vm_checks/memory_modes.py MODE

MODE: `v2-delegated` (the daemon alone in a cgroup with cpuset and memory
delegated, as systemd's Delegate=yes), `v2-root` (the daemon in the root
cgroup: a VM, a plain shell), `v1` (boot with --cgroup v1), `off` (`cgroup =
"off"`, the shipped pod config) and `seccomp` (cgroup v2 root, the daemon and
everything below it under a filter that refuses mbind, set_mempolicy,
migrate_pages and move_pages with EPERM, as a container runtime's default
seccomp profile does).

Default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3. In each mode three
daemons run one after the other, each with two ranks (rank 1 on node 1) and
workers that allocate as real ones do: WORKER_FIRST_MIB at once when they
start, then WORKER_STEP_MIB every second for WORKER_STEPS seconds, long
after they are adopted:

- `spawned`: the daemon spawns the workers through its shim;
- `vllm`: an engine (`[engine] kind = "vllm"`, -tp 2) starts them as vLLM
  does, `multiprocessing` spawn with target `WorkerProc.worker_main` and
  `local_rank`, and they title themselves `VLLM::Worker_TP<r>`;
- `late`: an env-rank launcher (LOCAL_RANK, torchrun's shape) whose workers
  run `python -S` (no site, so no start-up hook: a worker the daemon can
  only adopt), found by `rank_from = ["env:LOCAL_RANK"]`.

Checks per run and rank: every anonymous page of each worker on its rank's
node (>= 0.99, numa_maps) where the kernel allows a memory policy; under
seccomp what that mode gets instead (the capability reported, the CPUs
bound, pages allocated after adoption local) and, in every mode, the
`local_memory_ratio` /placement reports within 0.01 of numa_maps.
Prints "PASS name: detail" / "FAIL name: detail" per check (names hold no ": ").
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tests.support.children import status_field  # noqa: E402
from tests.support.daemon_support import DaemonProcess, to_toml  # noqa: E402
from tests.support.poll import wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402
from tests.vm_checks.daemon_numa import anon_pages_by_node  # noqa: E402

CHECKS = Checklist()
MODES = ("v2-delegated", "v2-root", "v1", "off", "seccomp")
RUNS = ("spawned", "vllm", "late")
ONLY = os.environ.get("MEMORY_MODES_RUNS")  # a comma list, to run a subset by hand
WORKER_FIRST_MIB, WORKER_STEP_MIB, WORKER_STEPS = 96, 16, 12
DELEGATED = Path("/sys/fs/cgroup/ps-delegated")

# A worker as real ones allocate: a block at start, then more every second.
ALLOCATE = f"""
import mmap, os, time
def touch(mib):
    buf = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for at in range(0, len(buf), 4096):
        buf[at] = 1
    return buf
def allocate(out):
    held = [touch({WORKER_FIRST_MIB})]
    for _ in range({WORKER_STEPS}):
        time.sleep(1)
        held.append(touch({WORKER_STEP_MIB}))
    open(out, "w").close()
    time.sleep(3600)
"""
SPAWNED_WORKER = (
    ALLOCATE
    + """
import sys
allocate(sys.argv[1] + "/done" + sys.argv[2])
"""
)
LATE_LAUNCHER = """
import os, subprocess, sys, time
worker, out = sys.argv[1:3]
for rank in range(2):
    env = dict(os.environ, LOCAL_RANK=str(rank))
    subprocess.Popen([sys.executable, "-S", worker, out, str(rank)], env=env)
time.sleep(3600)
"""
VLLM_ENGINE = """
import multiprocessing, sys, time
sys.path.insert(0, sys.argv[1])
from vllm_worker import WorkerProc
if __name__ == "__main__":  # spawn children import this file again as __mp_main__
    ctx = multiprocessing.get_context("spawn")
    kwargs = [{"local_rank": r, "out": sys.argv[2]} for r in range(2)]
    for kw in kwargs:
        ctx.Process(target=WorkerProc.worker_main, kwargs=kw).start()
    time.sleep(3600)
"""
VLLM_WORKER = (
    ALLOCATE
    + """
class WorkerProc:
    @staticmethod
    def worker_main(local_rank, out):
        import setproctitle
        setproctitle.setproctitle(f"VLLM::Worker_TP{local_rank}")
        allocate(f"{out}/done{local_rank}")
"""
)


def config_doc(run: str, mode: str, tmp: Path) -> dict[str, Any]:
    python = sys.executable
    doc: dict[str, Any] = {
        "cpu_ranks": 2,
        "stop_timeout_s": 5,
        "placement": {"rank_roles": {}},
        "drift": {"check_interval_s": 0.5, "numa_maps_interval_s": 1},
        "cgroup": "off" if mode == "off" else "auto",
    }
    if run == "spawned":
        doc["workers"] = {"command": [python, str(tmp / "spawned.py"), str(tmp), "{rank}"]}
    elif run == "vllm":
        doc["engine"] = {
            "command": [python, str(tmp / "vllm_engine.py"), str(tmp), str(tmp), "-tp", "2"],
            "kind": "vllm",
        }
        doc["workers"] = {"spawned_by": "engine"}
    else:
        doc["engine"] = {
            "command": [python, str(tmp / "late.py"), str(tmp / "late_worker.py"), str(tmp)]
        }
        doc["workers"] = {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]}
    return doc


def enter_mode(mode: str) -> None:
    """Put this process (and so the daemon it starts) where the mode runs it."""
    if mode != "v2-delegated":
        return
    root = Path("/sys/fs/cgroup")
    (root / "cgroup.subtree_control").write_text("+cpuset +memory")
    DELEGATED.mkdir(exist_ok=True)
    (DELEGATED / "cgroup.procs").write_text(str(os.getpid()))


def ratio_on(pid: int, node: int) -> tuple[float, dict[int, int]]:
    by_node, _ = anon_pages_by_node(pid)
    total = sum(by_node.values())
    return (by_node.get(node, 0) / total if total else 0.0), by_node


def run_one(run: str, mode: str, tmp: Path) -> None:
    for rank in (0, 1):
        (tmp / f"done{rank}").unlink(missing_ok=True)
    config = tmp / f"{run}.toml"
    config.write_text(to_toml(config_doc(run, mode, tmp)))
    prefix = (
        [sys.executable, f"{REPO}/tests/support/seccomp_exec.py", "memory", "--"]
        if mode == "seccomp"
        else []
    )
    daemon = DaemonProcess(config, f"/tmp/memory-{run}.log", prefix=prefix)
    try:
        doc = wait_until(daemon.running, timeout_s=240, interval_s=0.5)
        detail = "every process running" if doc is not None else daemon.tail(1500)
        if not CHECKS.check(f"{run} running", doc is not None, detail):
            return
        done = wait_until(
            lambda: all((tmp / f"done{r}").exists() for r in (0, 1)), timeout_s=240, interval_s=0.5
        )
        CHECKS.check(f"{run} workers allocated", bool(done), f"after {WORKER_STEPS} s of steps")
        time.sleep(4)  # a few checks: migrations, then a fresh numa_maps reading
        doc = daemon.running() or doc
        check_ranks(run, mode, doc, daemon)
    finally:
        code = daemon.stop(timeout_s=60)
        CHECKS.check(
            f"{run} clean stop", code == 0, f"exit {code}; {daemon.tail(800) if code else ''}"
        )


def check_ranks(run: str, mode: str, doc: dict[str, Any], daemon: DaemonProcess) -> None:
    caps = doc["supervisor"]["capabilities"]
    memory_allowed = mode != "seccomp"
    CHECKS.check(
        f"{run} mempolicy capability",
        caps["mempolicy"]["available"] == memory_allowed,
        f"mempolicy {caps['mempolicy']}",
    )
    for rank in doc["ranks"]:
        node = rank["mems"][0]
        pid = rank["pid"]
        ratio, by_node = ratio_on(pid, node)
        name = f"{run} rank {rank['rank']} on node {node}"
        if memory_allowed:
            CHECKS.check(f"{name} pages local", ratio >= 0.99, f"ratio {ratio:.4f} pages {by_node}")
        else:
            # No policy, no page moves: the CPUs place what is allocated after
            # adoption (first touch); what came before stays where it landed.
            CHECKS.check(
                f"{name} pages measured",
                sum(by_node.values()) > 0,
                f"ratio {ratio:.4f} pages {by_node}",
            )
        cpus = status_field(pid, "Cpus_allowed_list")
        CHECKS.check(
            f"{name} cpus", set(_cpus(cpus)) == set(rank["cpus"]), f"{cpus} planned {rank['cpus']}"
        )

        ok = wait_until(
            lambda r=rank["rank"], p=pid, n=node: reported_matches(daemon, r, p, n),
            timeout_s=30,
            interval_s=0.5,
        )
        CHECKS.check(
            f"{name} metric matches numa_maps",
            bool(ok),
            f"numa_maps ratio {ratio_on(pid, node)[0]:.4f}",
        )


def reported_matches(daemon: DaemonProcess, rank: int, pid: int, node: int) -> bool:
    """/placement's local_memory_ratio for `rank` is numa_maps' within 0.01."""
    live = daemon.running() or {}
    entry = next((r for r in live.get("ranks", ()) if r["rank"] == rank), None)
    observed = (entry or {}).get("observed") or {}
    reported = observed.get("local_memory_ratio")
    return reported is not None and abs(reported - ratio_on(pid, node)[0]) <= 0.01


def _cpus(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in MODES:
        print(f"usage: memory_modes.py {'|'.join(MODES)}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp())
    (tmp / "spawned.py").write_text(SPAWNED_WORKER)
    (tmp / "late.py").write_text(LATE_LAUNCHER)
    (tmp / "late_worker.py").write_text(
        ALLOCATE + "\nimport sys\nallocate(sys.argv[1] + '/done' + sys.argv[2])\n"
    )
    (tmp / "vllm_engine.py").write_text(VLLM_ENGINE)
    (tmp / "vllm_worker.py").write_text(VLLM_WORKER)
    enter_mode(mode)
    for run in ONLY.split(",") if ONLY else RUNS:
        try:
            run_one(run, mode, tmp)
        except AssertionError as err:
            CHECKS.check(f"{run} daemon up", False, str(err).replace("\n", " | ")[-1500:])
    return CHECKS.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
