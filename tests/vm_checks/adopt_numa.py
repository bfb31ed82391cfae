"""An engine-spawned worker adopted onto node 1; run INSIDE the test guest (as root).

    tests/guest/run-in-vm --nodes 2 -- .venv/bin/python -u tests/vm_checks/adopt_numa.py

Expects the default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3. The engine
(a launcher like torchrun, planned on node 0 and bound there by the shim,
MPOL_BIND included) starts one worker per rank; each worker first touches
64 MiB (on node 0, the engine's policy being inherited), then titles itself
`adopt-me-N` with the real setproctitle. The daemon adopts it then by
`cmdline:adopt-me-(\\d+)`: the worker planned on node 1 is moved into its
rank's cgroup (cpuset.mems = 1, memory_migrate = 1) and migrated, and its
pages must follow. Checks that it ends with at least 99% of its anonymous
pages on node 1, on node 1's CPUs. Prints "PASS name: detail" / "FAIL name: detail" per check.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from supervisor.cpulist import format_cpulist  # noqa: E402
from tests.support.children import status_field  # noqa: E402
from tests.support.daemon_support import DaemonProcess, to_toml  # noqa: E402
from tests.support.poll import wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402
from tests.vm_checks.daemon_numa import anon_pages_by_node  # noqa: E402

CHECKS = Checklist()

LAUNCHER = r"""
import os, subprocess, sys, time
worker, out, ready = sys.argv[1:4]
for rank in range(2):
    env = dict(os.environ, LOCAL_RANK=str(rank))
    subprocess.Popen([sys.executable, worker, out, str(rank)], env=env, start_new_session=True)
open(ready, "w").close()
time.sleep(3600)
"""

WORKER = r"""
import mmap, os, sys, time
import setproctitle
out, rank = sys.argv[1:3]
# Private anonymous memory, touched before the worker can be named: under the
# engine's inherited MPOL_BIND it lands on the engine's node (0).
buf = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for at in range(0, len(buf), 4096):
    buf[at] = 1
open(os.path.join(out, f"touched{rank}"), "w").close()
time.sleep(3)  # the check looks at where the pages are before adoption
setproctitle.setproctitle(f"adopt-me-{rank}")  # now `cmdline:` names it
time.sleep(3600)
"""


def main() -> int:
    tmp = Path(tempfile.mkdtemp())
    (tmp / "launcher.py").write_text(LAUNCHER)
    (tmp / "worker.py").write_text(WORKER)
    doc = {
        "cpu_ranks": 2,
        "stop_timeout_s": 5,
        "engine": {
            "command": [
                "python",
                str(tmp / "launcher.py"),
                str(tmp / "worker.py"),
                str(tmp),
                str(tmp / "ready"),
            ]
        },
        "ready": {"file": str(tmp / "ready"), "timeout_s": 120},
        "workers": {"spawned_by": "engine", "rank_from": [r"cmdline:adopt-me-(\d+)"]},
        "placement": {"rank_roles": {}},
        "drift": {"check_interval_s": 0.5},
    }
    config = tmp / "adopt.toml"
    config.write_text(to_toml(doc))
    daemon = DaemonProcess(config, "/tmp/adopt-daemon.log")
    try:
        return run_checks(daemon, tmp)
    except AssertionError as err:
        CHECKS.check("daemon up", False, str(err).replace("\n", " | "))
        return 1
    finally:
        daemon.stop(timeout_s=60)
        if CHECKS.failed:
            print("--- daemon log ---\n" + daemon.tail(6000), flush=True)


def adopted(daemon: DaemonProcess) -> dict | None:  # type: ignore[type-arg]
    doc = daemon.placement()
    if doc and all(r["state"] == "running" and r["adopted"] for r in doc["ranks"]):
        return doc
    return None


def unadopted_worker(daemon: DaemonProcess, rank: int) -> int | None:
    """The pid of the engine's worker for `rank` while it is still the engine's child."""
    doc = daemon.placement() or {"engine": {"children": []}}
    for child in doc["engine"]["children"]:
        if "worker.py" in child["cmdline"] and child["cmdline"].endswith(f" {rank}"):
            pid: int = child["pid"]
            return pid
    return None


def run_checks(daemon: DaemonProcess, tmp: Path) -> int:
    touched = wait_until((tmp / "touched1").exists, 240, 0.1)
    before = unadopted_worker(daemon, 1) if touched else None
    if before is not None:
        by_node, _ = anon_pages_by_node(before)
        CHECKS.check(
            "pages on node 0 before adoption",
            by_node.get(0, 0) > 10 * by_node.get(1, 0),
            f"pid {before} anon pages by node {by_node}",
        )
    else:
        CHECKS.check("pages on node 0 before adoption", False, "worker 1 not found unadopted")
    doc = wait_until(lambda: adopted(daemon), timeout_s=240, interval_s=0.5)
    CHECKS.check("adopted", doc is not None, "both ranks adopted" if doc else daemon.tail(2000))
    if doc is None:
        return 1
    ranks = {r["device"]["numa_node"]: r for r in doc["ranks"]}
    CHECKS.check("one rank per node", sorted(ranks) == [0, 1], f"rank nodes {sorted(ranks)}")
    if 1 not in ranks:
        return 1
    rank = ranks[1]
    pid = rank["pid"]
    CHECKS.check(
        "planned on node 1",
        rank["mems"] == [1] and set(rank["cpus"]) <= {2, 3},
        f"rank {rank['rank']} cpus={rank['cpus']} mems={rank['mems']}",
    )
    CHECKS.check(
        "engine on node 0",
        doc["engine"]["mems"] == [0],
        f"engine mems={doc['engine']['mems']} (its workers inherit MPOL_BIND to it)",
    )
    CHECKS.check("same worker adopted", pid == before, f"adopted pid {pid}, before {before}")

    def local_ratio() -> float:
        by_node, _ = anon_pages_by_node(pid)
        total = sum(by_node.values())
        return by_node.get(1, 0) / total if total else 0.0

    wait_until(lambda: local_ratio() >= 0.99, timeout_s=60, interval_s=0.5)
    by_node, policies = anon_pages_by_node(pid)
    ratio = local_ratio()
    CHECKS.check(
        "local memory ratio >= 0.99",
        ratio >= 0.99,
        f"ratio {ratio:.4f} anon pages by node {by_node} policies {sorted(policies)}",
    )
    cpus = status_field(pid, "Cpus_allowed_list")
    CHECKS.check(
        "worker affinity",
        cpus == format_cpulist(rank["cpus"]),
        f"Cpus_allowed_list={cpus} planned={rank['cpus']}",
    )
    failed = daemon.events("bind_failed")
    CHECKS.check(
        "no bind failure",
        failed == [],
        "; ".join(f"{e['rank']}: {e['message']} {e['fields']}" for e in failed) or "none",
    )
    code = daemon.stop(timeout_s=90)
    CHECKS.check("clean stop", code == 0, f"exit code {code}")
    time.sleep(0.5)
    left = [
        r["pid"]
        for r in doc["ranks"]
        if os.path.exists(f"/proc/{r['pid']}") and status_field(r["pid"], "State")[0] != "Z"
    ]
    CHECKS.check("no process left", not left, f"left: {left}")
    return CHECKS.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
