"""Rank cgroups changed by someone else, cgroup v2; run INSIDE the test guest, as root.

    tests/guest/run-in-vm --nodes 2 -- \
        .venv/bin/python -u tests/vm_checks/cgroup_repair.py

Default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3, cgroup2 at /sys/fs/cgroup.
The daemon runs in its own v2 cgroup `/ps-repair` (cpuset and memory
enabled, per-rank cgroups below it, `[drift.policy] cgroup` = enforce, the
default). This script plays another process: it rewrites rank 0's
`cpuset.cpus` to the other node's CPU (v2 then narrows its threads there),
widens it, rewrites rank 1's `cpuset.mems`, and moves rank 1 out and
removes its dir. Each must be put back by the check loop, the worker
never restarted, and each counted in drift_events{kind="cgroup"}.

Prints "PASS name: detail" / "FAIL name: detail"; exit 1 if any failed
(tests/watch/test_cgroup_repair_vm.py asserts on the lines).
"""

from __future__ import annotations

import os
import re
import sys
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from supervisor.cpulist import format_cpulist, parse_cpulist  # noqa: E402
from tests.support import children  # noqa: E402
from tests.support.daemon_support import DEMO_WORKER, INSTANCE_ENV, DaemonProcess  # noqa: E402
from tests.support.poll import wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402

CGROUP = "/sys/fs/cgroup"
SUP = f"{CGROUP}/ps-repair"
INSTANCE = "vmrepair"
INST = f"{SUP}/placement-supervisor-{INSTANCE}"
CHECKS = Checklist()


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return "(gone)"


def thread_cpus(pid: int) -> str:
    cpus = children.thread_cpus(pid).values()
    return format_cpulist(set().union(*(parse_cpulist(c) for c in cpus)))


def metric(daemon: DaemonProcess, pattern: str) -> int:
    """The value of the /metrics line `pattern` matches (-1 while it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return -1
    m = re.search(rf"^{pattern} (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else -1


def drift_events(daemon: DaemonProcess, rank: int) -> int:
    return metric(daemon, rf'placement_drift_events_total\{{kind="cgroup",rank="{rank}"\}}')


def checks(daemon: DaemonProcess) -> int:
    """How many check passes the daemon has finished."""
    return metric(daemon, "placement_check_duration_seconds_count")


def cgroup_drift(daemon: DaemonProcess, rank: int) -> bool:
    """Whether /placement shows a cgroup finding for `rank` now (True while unknown)."""
    doc = daemon.placement()
    if doc is None:
        return True
    entry = next(r for r in doc["ranks"] if r["rank"] == rank)
    return any(f.get("kind") == "cgroup" for f in entry.get("drift") or ())


@CHECKS.guarded("repair-scenario")
def scenario() -> None:
    write(f"{CGROUP}/cgroup.subtree_control", "+cpuset +memory")
    os.makedirs(SUP, exist_ok=True)
    write(f"{SUP}/cpuset.mems", "0-1")
    write(f"{SUP}/cpuset.cpus", "0-3")
    config = (
        'cpu_ranks = 2\ncgroup = "auto"\nstop_timeout_s = 5\n'
        f"[workers]\ncommand = {DEMO_WORKER!r}\n".replace("'", '"')
        + "[placement]\nrank_roles = {}\n[placement.engine]\nenabled = false\n"
        "[drift]\ncheck_interval_s = 0.5\n"
    )
    write("/tmp/repair.toml", config)
    env = dict(os.environ, **{INSTANCE_ENV: INSTANCE})
    daemon = DaemonProcess(
        "/tmp/repair.toml", "/tmp/repair.log", env=env, join=[f"{SUP}/cgroup.procs"]
    )
    try:
        doc = wait_until(daemon.running, 180, 0.25)
        CHECKS.check("repair-daemon-up", doc is not None, "both ranks running")
        if doc is None:
            return
        pids = {r["rank"]: r["pid"] for r in doc["ranks"]}
        plan = {
            r["rank"]: (format_cpulist(r["cpus"]), format_cpulist(r["mems"])) for r in doc["ranks"]
        }
        CHECKS.check("repair-start-plan", plan == {0: ("0-1", "0"), 1: ("2-3", "1")}, f"{plan}")
        r0, r1 = f"{INST}/rank0", f"{INST}/rank1"
        wait_until(lambda: thread_cpus(pids[0]) == "0-1", 20, 0.1)

        # (1) rank 0's cpuset rewritten to the other node's CPU: v2 narrows its threads.
        write(f"{r0}/cpuset.cpus", "2")
        ok = wait_until(
            lambda: read(f"{r0}/cpuset.cpus") == "0-1" and thread_cpus(pids[0]) == "0-1", 15, 0.05
        )
        CHECKS.check(
            "repair-v2-cpus-elsewhere",
            bool(ok),
            f"cpuset.cpus {read(f'{r0}/cpuset.cpus')}, threads {thread_cpus(pids[0])}",
        )
        counted = wait_until(lambda: drift_events(daemon, 0) == 1, 10, 0.1)
        CHECKS.check("repair-v2-counted", bool(counted), f"drift_events={drift_events(daemon, 0)}")

        # (2) widened: no thread moves, but the cgroup no longer confines the rank.
        # A finding is counted once while it lasts: first a pass that saw it
        # repaired (no cgroup drift left), so the next write is a new one.
        wait_until(lambda: not cgroup_drift(daemon, 0), 10, 0.1)
        seen = checks(daemon)
        wait_until(lambda: checks(daemon) >= seen + 2, 10, 0.05)  # a whole clean pass
        write(f"{r0}/cpuset.cpus", "0-3")
        ok = wait_until(lambda: read(f"{r0}/cpuset.cpus") == "0-1", 15, 0.05)
        twice = wait_until(lambda: drift_events(daemon, 0) == 2, 10, 0.1)
        CHECKS.check(
            "repair-v2-cpus-widened",
            bool(ok) and bool(twice),
            f"cpuset.cpus {read(f'{r0}/cpuset.cpus')}, drift_events={drift_events(daemon, 0)}",
        )

        # (3) rank 1's memory nodes rewritten.
        write(f"{r1}/cpuset.mems", "0-1")
        ok = wait_until(lambda: read(f"{r1}/cpuset.mems") == "1", 15, 0.05)
        CHECKS.check("repair-v2-mems", bool(ok), f"cpuset.mems {read(f'{r1}/cpuset.mems')}")

        # (4) rank 1 moved out (to the root: v2 allows no process in /ps-repair) and removed.
        # The daemon puts a process moved out of its rank's cgroup back (that is
        # what is tested next), so each try moves it out again right before the rmdir.
        def move_out_and_remove() -> bool:
            procs = read(f"{r1}/cgroup.procs")
            if procs == "(gone)":
                return True
            for pid in procs.split():
                write(f"{CGROUP}/cgroup.procs", pid)
            return _rmdir(r1)

        removed = wait_until(move_out_and_remove, 10, 0.05)
        CHECKS.check("repair-v2-removed", bool(removed), f"rmdir {r1}")
        ok = wait_until(
            lambda: (
                str(pids[1]) in read(f"{r1}/cgroup.procs").split()
                and read(f"{r1}/cpuset.cpus") == "2-3"
                and read(f"{r1}/cpuset.mems") == "1"
            ),
            15,
            0.05,
        )
        CHECKS.check(
            "repair-v2-remade",
            bool(ok),
            f"{r1}: procs {read(f'{r1}/cgroup.procs')}, cpus {read(f'{r1}/cpuset.cpus')}",
        )
        now = {r["rank"]: r["pid"] for r in (daemon.get("/placement") or {"ranks": []})["ranks"]}
        CHECKS.check("repair-v2-no-restart", now == pids, f"pids {pids} -> {now}")
    finally:
        code = daemon.stop(timeout_s=60)
        CHECKS.check("repair-clean-stop", code == 0, f"exit code {code}")
        if CHECKS.failed:
            print(f"--- {daemon.log} ---\n{daemon.tail(5000)}", flush=True)


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
    except OSError:
        return False  # busy until the kernel lets go: polled
    return True


def main() -> int:
    if os.environ.get("PS_GUEST") != "1":
        print("run me inside the test guest (tests/guest/run-in-vm)", file=sys.stderr)
        return 2
    scenario()
    return CHECKS.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
