"""Daemon benchmark: spawn-to-running through shim + daemon vs a direct spawn, and idle cost.

    .venv/bin/python -m tests.bench.daemon_bench [--rounds 20] [--cpu-window-s 20]

1. Spawn-to-running: the time from starting a child until its program's first
   instruction reports in (a datagram on a unix socket), (a) through the
   daemon's own spawn path (`Runner._spawn`: shim argv, spawn, report read,
   /proc stat, state updates) and (b) a direct `procs.spawn` of the same
   program, interleaved in one run; prints medians and their ratio.
2. The daemon's own CPU time per minute while it supervises the demo
   (utime + stime of /proc/<pid>/stat over a window, scaled to 60 s), next to
   what the demo processes themselves used in the same window.
No absolute numbers are asserted; the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvloop

from supervisor.config import parse_config
from supervisor.hostfs import HostFS
from supervisor.in_force import PlanInForce
from supervisor.plan.placement import Placement, Slot
from supervisor.procfs.stat import read_proc_stat
from supervisor.run.procs import ChildProcess, spawn
from supervisor.run.runner import Runner, Runtime
from supervisor.run.spec import ChildSpec
from supervisor.state import ProcessStatus, Snapshot, StateStore
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions
from tests.support.daemon_support import (
    REPO,
    DaemonProcess,
    entries,
)
from tests.support.poll import wait_until

FS = HostFS("/")
CLK_TCK = os.sysconf("SC_CLK_TCK")

# The benchmarked program: its first action tells the socket it runs.
CHILD = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
    "s.sendto(b'up', sys.argv[1])\n"
    "time.sleep(3600)\n"
)


async def wait_up(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    await loop.sock_recv(sock, 16)


async def spawn_rounds(rounds: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="daemon-bench-"))
    script = tmp / "child.py"
    script.write_text(CHILD)
    sock_path = str(tmp / "up.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.setblocking(False)
    argv = (sys.executable, str(script), sock_path)
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    topology = read_topology(FS, DiscoveryOptions(cpu_ranks=1))
    config = parse_config({"workers": {"command": list(argv)}, "cgroup": "off"}, "bench")
    slot = Slot(cpus, (0,), {"main": cpus})
    store = StateStore(
        Snapshot(
            placement=Placement("numa-affine", None, ()),
            topology=topology,
            processes={0: ProcessStatus(0)},
        )
    )
    executor = ThreadPoolExecutor(2)
    rt = Runtime(
        PlanInForce(config, topology, Placement("numa-affine", None, ())), store, FS, executor
    )
    spec = ChildSpec(0, argv, dict(os.environ), slot)
    runner = Runner(rt, 0, lambda _key: spec)
    direct_s: list[float] = []
    daemon_s: list[float] = []
    for _ in range(rounds):
        for path in ("direct", "daemon"):
            started = time.perf_counter()
            child: ChildProcess | None
            if path == "direct":
                child = spawn(argv, os.environ)
            else:
                child = await runner.spawn_child()
                assert child is not None and runner.report is not None
                runner.mark_running(child)
            await wait_up(sock)
            (direct_s if path == "direct" else daemon_s).append(time.perf_counter() - started)
            await child.stop(5.0)
    executor.shutdown()
    sock.close()
    direct = statistics.median(direct_s)
    daemon = statistics.median(daemon_s)
    return {
        "rounds": rounds,
        "direct_median_ms": round(direct * 1000, 2),
        "daemon_median_ms": round(daemon * 1000, 2),
        "ratio_daemon_over_direct": round(daemon / direct, 2),
    }


def cpu_ticks(pid: int) -> int:
    stat = read_proc_stat(FS, pid)
    return 0 if stat is None else stat.utime_ticks + stat.stime_ticks


def daemon_cpu(window_s: float) -> dict[str, Any]:
    env = dict(os.environ, PLACEMENT_SUPERVISOR_INSTANCE=f"bench-{os.getpid()}")
    log = Path(tempfile.mkdtemp(prefix="daemon-bench-")) / "daemon.log"
    with DaemonProcess(REPO / "supervisor/demo/demo.toml", log, env=env) as daemon:
        doc = wait_until(daemon.running, 60, 0.2)
        if not doc:
            raise SystemExit("the demo did not come up within 60 s")
        children = [e["pid"] for e in entries(doc)]
        # Settle: the workers allocate for their first seconds.
        time.sleep(2.0)
        d0, c0, t0 = cpu_ticks(daemon.pid), sum(map(cpu_ticks, children)), time.monotonic()
        time.sleep(window_s)
        d1, c1, t1 = cpu_ticks(daemon.pid), sum(map(cpu_ticks, children)), time.monotonic()
    elapsed = t1 - t0
    daemon_s = (d1 - d0) / CLK_TCK
    demo_s = (c1 - c0) / CLK_TCK
    return {
        "window_s": round(elapsed, 1),
        "daemon_cpu_s_per_min": round(daemon_s * 60 / elapsed, 3),
        # At least one tick, for when the daemon used less than the clock resolves.
        "daemon_cpu_s_per_min_upper_bound": round(max(d1 - d0, 1) / CLK_TCK * 60 / elapsed, 3),
        "demo_cpu_s_per_min": round(demo_s * 60 / elapsed, 3),
        "ratio_daemon_over_demo": round(daemon_s / demo_s, 4) if demo_s else None,
        "tick_s": 1 / CLK_TCK,
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.daemon_bench")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cpu-window-s", type=float, default=20.0)
    args = parser.parse_args()
    spawn_result = uvloop.run(spawn_rounds(args.rounds))
    print(
        f"spawn-to-running: direct {spawn_result['direct_median_ms']} ms,"
        f" shim+daemon {spawn_result['daemon_median_ms']} ms"
        f" (ratio {spawn_result['ratio_daemon_over_direct']}x, median of {args.rounds})"
    )
    cpu = daemon_cpu(args.cpu_window_s)
    print(
        f"daemon CPU: {cpu['daemon_cpu_s_per_min']} s/min"
        f" (<= {cpu['daemon_cpu_s_per_min_upper_bound']}) while the demo used"
        f" {cpu['demo_cpu_s_per_min']} s/min (ratio {cpu['ratio_daemon_over_demo']},"
        f" window {cpu['window_s']} s)"
    )
    print(json.dumps({"spawn": spawn_result, "cpu": cpu}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
