"""CPU hotplug in a 2-node guest; run INSIDE the test guest (as root).

    tests/guest/run-in-vm --nodes 2 -- \
        .venv/bin/python -u tests/vm_checks/checker_hotplug.py

Default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3. A daemon with one rank per
node (cpu stand-ins, no engine) plans rank 0 on 0-1 and rank 1 on 2-3. Taking
CPU 3 offline (/sys/devices/system/cpu/cpu3/online = 0) shrinks what the
supervisor may use without any cpuset write: the check loop must see it,
re-plan rank 1 onto CPU 2 and re-bind its threads; bringing CPU 3 back must
return rank 1 to 2-3, without restarting anything.

Prints "PASS name: detail" / "FAIL name: detail"; exit 1 if any failed
(tests/watch/test_checker_vm.py asserts on the lines).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from supervisor.cpulist import format_cpulist  # noqa: E402
from tests.support import children  # noqa: E402
from tests.support.daemon_support import DEMO_WORKER, INSTANCE_ENV, DaemonProcess  # noqa: E402
from tests.support.poll import wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402

CPU3 = "/sys/devices/system/cpu/cpu3/online"
CHECKS = Checklist()
CONFIG = (
    'cpu_ranks = 2\ncgroup = "off"\nstop_timeout_s = 5\n'
    f"[workers]\ncommand = {json.dumps([*DEMO_WORKER, '--mem-cap-mib', '8'])}\n"
    "[placement]\nrank_roles = {}\n[placement.engine]\nenabled = false\n"
    '[threads.comm]\nprocess = "workers"\npattern = "comm*"\n'
    "[drift]\ncheck_interval_s = 0.5\n"
)


def set_online(online: bool) -> None:
    with open(CPU3, "w") as f:
        f.write("1" if online else "0")


def live_cpus(pid: int) -> set[int]:
    """The CPUs the threads of `pid` may run on, as the scheduler sees them.

    sched_getaffinity(2) answers the task's mask & the active CPUs, which is
    what the check loop compares; /proc/<pid>/status keeps showing an offline
    CPU that was in the mask, because the kernel leaves the mask alone.
    """
    cpus: set[int] = set()
    for tid in children.thread_cpus(pid):
        with contextlib.suppress(OSError):  # the thread exited since the listing
            cpus |= os.sched_getaffinity(tid)
    return cpus


@CHECKS.guarded("hotplug-scenario")
def scenario() -> None:
    with open("/tmp/hotplug.toml", "w") as f:
        f.write(CONFIG)
    env = dict(os.environ, **{INSTANCE_ENV: "hotplug"})
    daemon = DaemonProcess("/tmp/hotplug.toml", "/tmp/hotplug.log", env=env)
    try:
        doc: dict[str, Any] | None = wait_until(daemon.running, 180, 0.25)
        if not CHECKS.check("hotplug-daemon-up", doc is not None, "both ranks running"):
            return
        assert doc is not None
        pids = {r["rank"]: r["pid"] for r in doc["ranks"]}
        plan = {r["rank"]: r["cpus"] for r in doc["ranks"]}
        CHECKS.check("hotplug-start-plan", plan == {0: [0, 1], 1: [2, 3]}, f"ranks {plan}")

        set_online(False)

        def shrunk() -> dict[str, Any] | None:
            d = daemon.get("/placement")
            if d is None:
                return None
            planned = {r["rank"]: r["cpus"] for r in d["ranks"]}
            return d if planned[1] == [2] and live_cpus(pids[1]) == {2} else None

        doc = wait_until(shrunk, 30, 0.1)
        now = daemon.get("/placement") or {"ranks": []}
        CHECKS.check(
            "hotplug-offline-replans",
            doc is not None,
            f"cpu3 offline: plan {[r['cpus'] for r in now['ranks']]}, "
            f"rank 1 threads on {format_cpulist(live_cpus(pids[1]))}",
        )
        CHECKS.check(
            "hotplug-rank0-untouched",
            live_cpus(pids[0]) == {0, 1},
            f"rank 0 threads on {format_cpulist(live_cpus(pids[0]))}",
        )
        changes = (daemon.get("/placement") or {}).get("supervisor", {}).get("cpuset_changes")
        CHECKS.check("hotplug-counted", changes == 1, f"cpuset_changes={changes}")

        set_online(True)
        ok = wait_until(lambda: live_cpus(pids[1]) == {2, 3}, 30, 0.1)
        CHECKS.check(
            "hotplug-online-restores",
            bool(ok),
            f"cpu3 online: rank 1 threads on {format_cpulist(live_cpus(pids[1]))}",
        )
        after = {r["rank"]: r["pid"] for r in (daemon.get("/placement") or {"ranks": []})["ranks"]}
        CHECKS.check("hotplug-no-restart", after == pids, f"pids {pids} -> {after}")
    finally:
        set_online(True)
        code = daemon.stop(timeout_s=60)
        CHECKS.check("hotplug-clean-stop", code == 0, f"exit code {code}")
        if CHECKS.failed:
            print(f"--- {daemon.log} ---\n{daemon.tail(5000)}", flush=True)


if __name__ == "__main__":
    scenario()
    sys.exit(CHECKS.exit_code())
