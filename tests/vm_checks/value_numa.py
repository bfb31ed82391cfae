"""What binding buys in memory locality; run INSIDE the test guest (tests/guest/) (as root).

    tests/guest/run-in-vm --nodes 2 --mem 3G --append numa_balancing=enable -- \
        .venv/bin/python -u tests/vm_checks/value_numa.py

Expects the default guest shape: node 0 = CPUs 0-1, node 1 = CPUs 2-3. The
worker for rank 1 (its device on node 1) allocates as a worker does: 128 MiB
of pinned-style host buffers (mmap, touched, mlock(2)ed: staging buffers for
host-to-device copies) at start, then a 384 MiB KV-like pool, touched; then
it keeps touching both every 2 s. Three ways of running it, one after the
other:
  birth      spawned by the daemon as rank 1 (the shim binds CPUs and
             MPOL_BIND before the exec);
  adopted    spawned by an engine bound to node 0 (the worker inherits its
             policy, so every page starts on node 0), then titled with
             setproctitle and adopted by `cmdline:`: its cgroup and a
             migration must bring the pages to node 1;
  autonuma   started plainly, no binding, with the kernel's NUMA balancing
             on (numa_balancing=1), measured after AUTONUMA_S seconds.
"PASS"/"FAIL" lines for ours (>= 0.99 of its anonymous pages on node 1);
an "INFO autonuma: ..." line with AutoNUMA's fractions, which depend on where
the scheduler ran the worker and are printed, not judged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tests.support.daemon_support import DaemonProcess, to_toml  # noqa: E402
from tests.support.poll import wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402
from tests.vm_checks.daemon_numa import anon_pages_by_node  # noqa: E402

CHECKS = Checklist()
NODE = 1  # rank 1's device node in the default guest
AUTONUMA_S = 30.0  # scan delay 1 s, then 256 MiB per scan period (sched/fair.c defaults)

WORKER = r"""
import ctypes, mmap, os, sys, time
out, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
MIB = 1 << 20
libc = ctypes.CDLL(None, use_errno=True)

def region(size):
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

def touch(buf):
    for at in range(0, len(buf), 4096):
        buf[at] = 1

def title():
    if mode == "adopted":
        import setproctitle
        setproctitle.setproctitle(f"value-rank-{rank}")

if rank != 1:  # only rank 1 (device on node 1) allocates; rank 0 just runs
    title()
    time.sleep(3600)
pinned = [region(32 * MIB) for _ in range(4)]  # host staging buffers, touched at start
for buf in pinned:
    touch(buf)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(len(buf))) != 0:
        sys.exit(f"mlock failed errno={ctypes.get_errno()}")
kv = region(384 * MIB)  # the KV-cache-like pool, allocated once the model is up
touch(kv)
open(os.path.join(out, f"touched{rank}"), "w").close()
if mode == "adopted":
    time.sleep(3)  # the check reads where the pages are before adoption
title()
while True:  # a worker keeps using its buffers (AutoNUMA samples accesses)
    time.sleep(2)
    for buf in (*pinned, kv):
        touch(buf)
"""

# An engine like torchrun: starts one worker per rank and waits (as adopt_numa.py's).
LAUNCHER = r"""
import os, subprocess, sys, time
worker, out, ready = sys.argv[1:4]
for rank in range(2):
    env = dict(os.environ, LOCAL_RANK=str(rank))
    subprocess.Popen([sys.executable, worker, out, str(rank), "adopted"], env=env,
                     start_new_session=True)
open(ready, "w").close()
time.sleep(3600)
"""


def fraction_on(pid: int, node: int) -> tuple[float, dict[int, int]]:
    by_node, _ = anon_pages_by_node(pid)
    total = sum(by_node.values())
    return (by_node.get(node, 0) / total if total else 0.0), by_node


def run_daemon(tmp: Path, doc: dict[str, Any], name: str) -> DaemonProcess:
    config = tmp / f"{name}.toml"
    config.write_text(to_toml(doc))
    return DaemonProcess(config, tmp / f"{name}.log")


def rank_on_node(daemon: DaemonProcess, adopted: bool) -> dict[str, Any] | None:
    doc = daemon.placement()
    if not doc:
        return None
    ranks = [r for r in doc["ranks"] if r["state"] == "running" and r.get("pid")]
    if adopted:
        ranks = [r for r in ranks if r.get("adopted")]
    return next((r for r in ranks if r["mems"] == [NODE]), None)


def engine_child(daemon: DaemonProcess) -> int | None:
    """The pid of rank 1's worker while it is still only the engine's child."""
    doc = daemon.placement() or {"engine": {"children": []}}
    for child in doc["engine"]["children"]:
        if "worker.py" in child["cmdline"] and child["cmdline"].endswith(" 1 adopted"):
            pid: int = child["pid"]
            return pid
    return None


def measure(name: str, daemon: DaemonProcess, tmp: Path, adopted: bool) -> None:
    try:
        if not wait_until((tmp / "touched1").exists, 240, 0.2):
            CHECKS.check(f"{name} local >= 0.99", False, "worker never touched its memory")
            return
        if adopted:
            before = wait_until(lambda: engine_child(daemon), 10, 0.1)
            ratio0, by_node = fraction_on(before, 0) if before else (0.0, {})
            CHECKS.check(
                "adopted starts on node 0",
                ratio0 >= 0.9,
                f"pid {before} before adoption: {ratio0:.4f} on node 0, pages by node {by_node}",
            )
        rank = wait_until(lambda: rank_on_node(daemon, adopted), 240, 0.2)
        if rank is None:
            CHECKS.check(f"{name} local >= 0.99", False, f"no rank on node {NODE}")
            return
        pid = rank["pid"]
        # Adoption migrates after it moves the process: give the kernel its time.
        wait_until(lambda: fraction_on(pid, NODE)[0] >= 0.99, 90, 0.5)
        ratio, by_node = fraction_on(pid, NODE)
        mib = sum(by_node.values()) * os.sysconf("SC_PAGE_SIZE") >> 20
        CHECKS.check(
            f"{name} local >= 0.99",
            ratio >= 0.99,
            f"local {ratio:.4f} of {mib} MiB anonymous, pages by node {by_node}",
        )
    finally:
        daemon.stop(timeout_s=60)
        if CHECKS.failed:
            print(f"--- {name} daemon log ---\n" + daemon.tail(4000), flush=True)


def birth(tmp: Path, worker: Path) -> None:
    doc = {
        "cpu_ranks": 2,
        "stop_timeout_s": 5,
        "workers": {"command": ["python", str(worker), str(tmp), "{rank}", "birth"]},
        "placement": {"rank_roles": {}, "engine": {"enabled": False}},
    }
    measure("birth", run_daemon(tmp, doc, "birth"), tmp, adopted=False)


def adopted(tmp: Path, worker: Path) -> None:
    launcher = tmp / "launcher.py"
    launcher.write_text(LAUNCHER)
    doc = {
        "cpu_ranks": 2,
        "stop_timeout_s": 5,
        "engine": {"command": ["python", str(launcher), str(worker), str(tmp), str(tmp / "up")]},
        "ready": {"file": str(tmp / "up"), "timeout_s": 120},
        "workers": {"spawned_by": "engine", "rank_from": [r"cmdline:value-rank-(\d+)"]},
        "placement": {"rank_roles": {}},
        "drift": {"check_interval_s": 0.5},
    }
    measure("adopted", run_daemon(tmp, doc, "adopted"), tmp, adopted=True)


def last_cpu_node(pid: int) -> int | None:
    """The node of the CPU the process's main thread last ran on (stat field 39)."""
    with open(f"/proc/{pid}/stat") as f:
        cpu = int(f.read().rsplit(")", 1)[1].split()[36])
    for node in os.listdir(f"/sys/devices/system/cpu/cpu{cpu}"):
        if node.startswith("node") and node[4:].isdigit():
            return int(node[4:])
    return None


def vmstat() -> dict[str, int]:
    """NUMA balancing's counters in /proc/vmstat (is AutoNUMA doing anything?)."""
    keys = ("numa_pte_updates", "numa_hint_faults", "numa_pages_migrated")
    with open("/proc/vmstat") as f:
        pairs = (line.split() for line in f)
        return {k: int(v) for k, v in pairs if k in keys}


def autonuma(tmp: Path, worker: Path) -> None:
    with open("/proc/sys/kernel/numa_balancing") as f:
        balancing = f.read().strip()
    if balancing != "1":
        CHECKS.skip("autonuma", f"numa_balancing={balancing}, boot with numa_balancing=enable")
        return
    proc = subprocess.Popen([sys.executable, str(worker), str(tmp), "1", "plain"])
    try:
        if not wait_until((tmp / "touched1").exists, 240, 0.2):
            print("INFO autonuma: the worker never touched its memory", flush=True)
            return
        counters = vmstat()
        time.sleep(AUTONUMA_S)  # the measurement window itself, not a synchronisation
        moved = {k: v - counters.get(k, 0) for k, v in vmstat().items()}
        ratio, by_node = fraction_on(proc.pid, NODE)
        ran = last_cpu_node(proc.pid)
        here = fraction_on(proc.pid, ran)[0] if ran is not None else float("nan")
        print(
            f"INFO autonuma: on its device's node {NODE} {ratio:.4f}; on node {ran}, where "
            f"it last ran, {here:.4f}; after {AUTONUMA_S:.0f} s, pages by node {by_node}; "
            + " ".join(f"{k}=+{v}" for k, v in moved.items()),
            flush=True,
        )
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    worker = Path(tempfile.mkdtemp()) / "worker.py"
    worker.write_text(WORKER)
    for name, phase in (("birth", birth), ("adopted", adopted), ("autonuma", autonuma)):
        tmp = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        try:
            phase(tmp, worker)
        except Exception as err:  # one phase's breakage is its FAIL, not the script's end
            CHECKS.check(f"{name} local >= 0.99", False, repr(err))
    return CHECKS.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
