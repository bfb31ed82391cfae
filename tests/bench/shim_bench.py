"""Spawn-to-running latency through the exec shim vs a direct spawn, in one run.

    .venv/bin/python -m tests.bench.shim_bench [--runs N]

Children: `/bin/true` (spawn to exit) and a Python child that writes one byte
on stdout as its first action (spawn to ready). Each is started directly, through
the shim as `shim_argv` runs it (`python -I -S -c stub`, with a report fd), and
through `python -m supervisor.run.shim`. The modes alternate run by run, so machine
noise hits them alike. Prints medians and p99 in ms and ratios to direct; no
absolute thresholds (this machine is shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from supervisor.bind.report import parse_shim_report, shim_argv

READY_CHILD = "import os; os.write(1, b'r')"


def spawn_true(argv_for: Callable[[list[str]], tuple[list[str], int | None]]) -> float:
    argv, report_w = argv_for(["/bin/true"])
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, pass_fds=[report_w] if report_w is not None else [])
    if report_w is not None:
        os.close(report_w)
    proc.wait()
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0
    return elapsed


def spawn_ready(argv_for: Callable[[list[str]], tuple[list[str], int | None]]) -> float:
    argv, report_w = argv_for([sys.executable, "-c", READY_CHILD])
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, pass_fds=[report_w] if report_w is not None else []
    )
    if report_w is not None:
        os.close(report_w)
    assert proc.stdout is not None
    assert proc.stdout.read(1) == b"r"
    elapsed = time.perf_counter() - t0
    proc.wait()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    pending: list[int] = []

    def direct(cmd: list[str]) -> tuple[list[str], int | None]:
        return cmd, None

    def shim_isolated(cmd: list[str]) -> tuple[list[str], int | None]:
        r, w = os.pipe()
        pending.append(r)
        return shim_argv(sys.executable, cpus, [0], cmd, report_fd=w, parent_pid=os.getpid()), w

    def shim_module(cmd: list[str]) -> tuple[list[str], int | None]:
        r, w = os.pipe()
        pending.append(r)
        argv = shim_argv(
            sys.executable, cpus, [0], cmd, report_fd=w, parent_pid=os.getpid(), isolated=False
        )
        return argv, w

    def drain() -> None:
        while pending:
            r = pending.pop()
            data = b""
            while chunk := os.read(r, 65536):
                data += chunk
            os.close(r)
            assert parse_shim_report(data).mempolicy == "bind"

    modes = {"direct": direct, "shim -I -S (default)": shim_isolated, "shim -m": shim_module}
    for child, spawn in (("/bin/true", spawn_true), ("python ready", spawn_ready)):
        samples: dict[str, list[float]] = {name: [] for name in modes}
        for argv_for in modes.values():  # warm-up: page cache, .pyc files
            spawn(argv_for)
            drain()
        for _ in range(args.runs):
            for name, argv_for in modes.items():
                samples[name].append(spawn(argv_for))
                drain()
        base = statistics.median(samples["direct"])
        print(f"child: {child}  (runs={args.runs})")
        for name, values in samples.items():
            values.sort()
            med = statistics.median(values)
            p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
            print(
                f"  {name:22s} median {med * 1e3:7.2f} ms  p99 {p99 * 1e3:7.2f} ms"
                f"  median/direct {med / base:5.2f}  extra {(med - base) * 1e3:6.2f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
