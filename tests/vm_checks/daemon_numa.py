"""The daemon with the demo config in a 2-node guest; run INSIDE the test guest (as root).

    tests/guest/run-in-vm --nodes 2 -- .venv/bin/python -u tests/vm_checks/daemon_numa.py

Expects the default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3. Starts
`python -m supervisor run --config supervisor/demo/demo.toml`, waits until
every process runs and the rank planned on node 1 has touched 64 MiB, and
checks from /proc that this worker runs on node 1's CPUs under MPOL_BIND and
that every anonymous page it has is on node 1. Prints "PASS name: detail" or
"FAIL name: detail" per check and exits 1 if any failed
(tests/daemon/test_root_vm.py asserts on these lines).
"""

from __future__ import annotations

import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from supervisor.cpulist import format_cpulist  # noqa: E402
from tests.support.children import status_field  # noqa: E402
from tests.support.daemon_support import DaemonProcess  # noqa: E402
from tests.support.poll import wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402

CHECKS = Checklist()
_NODE_PAGES = re.compile(r"\bN(\d+)=(\d+)")


def anon_pages_by_node(pid: int) -> tuple[dict[int, int], set[str]]:
    """Pages per node of the anonymous mappings (no file=), and their policies."""
    pages: dict[int, int] = {}
    policies: set[str] = set()
    with open(f"/proc/{pid}/numa_maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 2 or any(w.startswith("file=") for w in fields):
                continue
            if "anon=" not in line:
                continue
            policies.add(fields[1])
            for node, count in _NODE_PAGES.findall(line):
                pages[int(node)] = pages.get(int(node), 0) + int(count)
    return pages, policies


def main() -> int:
    daemon = DaemonProcess(os.path.join(REPO, "supervisor/demo/demo.toml"), "/tmp/daemon.log")
    try:
        return run_checks(daemon)
    except AssertionError as err:  # DaemonProcess.running: the daemon exited
        CHECKS.check("daemon up", False, str(err).replace("\n", " | "))
        return 1
    finally:
        daemon.stop(timeout_s=60)
        if CHECKS.failed:
            print("--- daemon log ---\n" + daemon.tail(6000), flush=True)


def run_checks(daemon: DaemonProcess) -> int:
    doc = wait_until(daemon.running, timeout_s=240, interval_s=0.5)
    CHECKS.check("daemon up", doc is not None, "all processes running" if doc else "timed out")
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
        "shim bound memory",
        rank["mempolicy"]["step"] == "bind",
        f"mempolicy={rank['mempolicy']}",
    )
    cpus = status_field(pid, "Cpus_allowed_list")
    planned = format_cpulist(rank["cpus"])
    CHECKS.check("worker affinity", cpus == planned, f"Cpus_allowed_list={cpus} planned={planned}")

    # The demo worker touches 16 MiB per second up to 128 MiB.
    page_kib = os.sysconf("SC_PAGE_SIZE") // 1024

    def grown() -> bool:
        return sum(anon_pages_by_node(pid)[0].values()) * page_kib >= 64 * 1024

    pages = wait_until(grown, timeout_s=120, interval_s=0.5)
    by_node, policies = anon_pages_by_node(pid)
    mib = {node: count * page_kib // 1024 for node, count in sorted(by_node.items())}
    CHECKS.check("worker memory grew", bool(pages), f"anon MiB by node {mib}")
    CHECKS.check(
        "anonymous memory on node 1 only",
        bool(by_node) and set(by_node) == {1},
        f"anon pages by node {by_node}",
    )
    CHECKS.check(
        "policy bind:1", policies == {"bind:1"}, f"anon mapping policies {sorted(policies)}"
    )
    other = ranks[0]
    other_nodes = set(anon_pages_by_node(other["pid"])[0])
    CHECKS.check(
        "the node-0 rank stays on node 0", other_nodes == {0}, f"nodes {sorted(other_nodes)}"
    )

    code = daemon.stop(timeout_s=90)
    CHECKS.check("clean stop", code == 0, f"exit code {code}")
    pids = [e["pid"] for e in [doc.get("engine"), *doc["ranks"]] if e]
    left = [p for p in pids if os.path.exists(f"/proc/{p}") and status_field(p, "State")[0] != "Z"]
    CHECKS.check("no process left", not left, f"left: {left}")
    return CHECKS.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
