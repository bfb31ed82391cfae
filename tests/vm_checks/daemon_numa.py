"""The daemon with the demo config in a 2-node guest; run INSIDE the numavm guest (as root).

    ../shared/tools/numavm/run-in-vm --nodes 2 -- .venv/bin/python -u tests/vm_checks/daemon_numa.py

Expects the default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3. Starts
`python -m supervisor run --config supervisor/demo/demo.toml`, waits until
every process runs and the rank planned on node 1 has touched 64 MiB, and
checks from /proc that this worker runs on node 1's CPUs under MPOL_BIND and
that every anonymous page it has is on node 1. Prints "PASS name: detail" or
"FAIL name: detail" per check and exits 1 if any failed
(tests/test_daemon_vm.py asserts on these lines).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from supervisor.cpulist import format_cpulist  # noqa: E402

PORT = 19477
FAILED: list[str] = []
_NODE_PAGES = re.compile(r"\bN(\d+)=(\d+)")


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def placement() -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/placement", timeout=5) as resp:
            doc: dict[str, Any] = json.load(resp)
            return doc
    except OSError:
        return None


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


def status_field(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    return "?"


def wait(predicate: Any, timeout_s: float, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


def main() -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "supervisor",
            "run",
            "--config",
            os.path.join(REPO, "supervisor/demo/demo.toml"),
            "--listen",
            f"127.0.0.1:{PORT}",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open("/tmp/daemon.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    try:
        return run_checks(daemon)
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if FAILED:
            with open("/tmp/daemon.log") as f:
                print("--- daemon log ---\n" + f.read()[-6000:], flush=True)


def run_checks(daemon: subprocess.Popen[bytes]) -> int:
    def up() -> dict[str, Any] | None:
        doc = placement()
        if doc is None:
            return None
        everyone = [doc["engine"], *doc["ranks"]] if doc.get("engine") else doc["ranks"]
        return doc if all(e["state"] == "running" and e["pid"] for e in everyone) else None

    doc = wait(up, timeout_s=240)
    check("daemon up", doc is not None, "all processes running" if doc else "timed out")
    if doc is None:
        return 1
    ranks = {r["device"]["numa_node"]: r for r in doc["ranks"]}
    check("one rank per node", sorted(ranks) == [0, 1], f"rank nodes {sorted(ranks)}")
    if 1 not in ranks:
        return 1
    rank = ranks[1]
    pid = rank["pid"]
    check(
        "planned on node 1",
        rank["mems"] == [1] and set(rank["cpus"]) <= {2, 3},
        f"rank {rank['rank']} cpus={rank['cpus']} mems={rank['mems']}",
    )
    check(
        "shim bound memory",
        rank["mempolicy"]["step"] == "bind",
        f"mempolicy={rank['mempolicy']}",
    )
    cpus = status_field(pid, "Cpus_allowed_list")
    planned = format_cpulist(rank["cpus"])
    check("worker affinity", cpus == planned, f"Cpus_allowed_list={cpus} planned={planned}")

    # The demo worker touches 16 MiB per second up to 128 MiB.
    page_kib = os.sysconf("SC_PAGE_SIZE") // 1024

    def grown() -> bool:
        return sum(anon_pages_by_node(pid)[0].values()) * page_kib >= 64 * 1024

    pages = wait(grown, timeout_s=120)
    by_node, policies = anon_pages_by_node(pid)
    mib = {node: count * page_kib // 1024 for node, count in sorted(by_node.items())}
    check("worker memory grew", bool(pages), f"anon MiB by node {mib}")
    check(
        "anonymous memory on node 1 only",
        bool(by_node) and set(by_node) == {1},
        f"anon pages by node {by_node}",
    )
    check("policy bind:1", policies == {"bind:1"}, f"anon mapping policies {sorted(policies)}")
    other = ranks[0]
    other_nodes = set(anon_pages_by_node(other["pid"])[0])
    check("the node-0 rank stays on node 0", other_nodes == {0}, f"nodes {sorted(other_nodes)}")

    daemon.send_signal(signal.SIGTERM)
    code = daemon.wait(timeout=90)
    check("clean stop", code == 0, f"exit code {code}")
    pids = [e["pid"] for e in [doc.get("engine"), *doc["ranks"]] if e]
    left = [p for p in pids if os.path.exists(f"/proc/{p}") and status_field(p, "State")[0] != "Z"]
    check("no process left", not left, f"left: {left}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
