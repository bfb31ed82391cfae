"""Benchmark: the cost of one drift check cycle and of one memory-locality read.

Run: `.venv/bin/python -m tests.bench.check_bench [--quick]` (as root: it creates
a v1 memory cgroup). Real child processes with idle named threads; every number
is a median over repeated cycles, printed with its ratio to a baseline measured
in the same run:

- check cycle (list threads, read affinity and names, match roles, diff
  against the slot) for 8 ranks x 100 threads and 16 ranks x 300 threads,
  against (a) the syscall floor, one os.sched_getaffinity per known tid, and
  (b) the subprocess approach (`ps -T -p PID` per process plus
  `taskset -p TID` per thread, as vllm-ascend does), timed on a subset and
  extrapolated per thread;
- locality read: parse of /proc/<pid>/numa_maps against reading the
  process's cgroup memory.numa_stat, at 1 GiB and 4 GiB resident.

Children and cgroups are always cleaned up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack

from supervisor.hostfs import HostFS
from supervisor.plan.keys import ThreadRole
from supervisor.plan.placement import Slot
from supervisor.plan.threads import RoleMatcher
from supervisor.procfs.numa_maps import read_numa_maps
from supervisor.watch.drift import diff
from supervisor.watch.observe import ThreadScanner, observe_process, read_threads
from tests.support.cgroup_v1 import V1_MEMORY, v1_cgroup
from tests.support.children import ThreadedChild

FS = HostFS("/")
ROLES = (
    ThreadRole("acl", "workers", "acl_thread"),
    ThreadRole("release", "workers", "release_thread"),
    ThreadRole("comm", "workers", "hccl*"),
)
GIB = 1 << 30
TARGET_FLOOR_RATIO = 3.0
TARGET_SUBPROCESS_SPEEDUP = 50.0


def median_s(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of `repeat` calls, after one warm-up call."""
    fn()  # warm: first listing, name reads, role memo
    times: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def amortized_s(fn: Callable[[], object], window: int, windows: int) -> float:
    """Median over `windows` runs of `window` calls of the mean call time.

    A window spans the scanner's periodic work (relists, name refreshes), so
    this is the amortized cost; the median of windows drops the odd window
    slowed by another process on this shared machine.
    """
    fn()
    means: list[float] = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(window):
            fn()
        means.append((time.perf_counter() - t0) / window)
    return statistics.median(means)


def thread_names(n: int) -> list[str]:
    fixed = ["acl_thread", "release_thread", "hccl_poll"]
    return fixed + [f"worker-{i}" for i in range(max(0, n - len(fixed) - 1))]  # + main thread


def rank_slot() -> Slot:
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    return Slot(cpus, (0,), {"main": cpus, "acl": cpus[-1:], "release": cpus[-1:]})


def bind_as_planned(child: ThreadedChild, slot: Slot) -> None:
    """Steady state: the acl and release threads sit on their role's CPUs."""
    os.sched_setaffinity(child.threads["acl_thread"], slot.role_cpus("acl"))
    os.sched_setaffinity(child.threads["release_thread"], slot.role_cpus("release"))


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms"


def bench_cycle(ranks: int, threads: int, repeat: int, subset: int) -> bool:
    slot = rank_slot()
    with ExitStack() as stack:
        children = [
            stack.enter_context(ThreadedChild(thread_names(threads), timeout_s=120.0))
            for _ in range(ranks)
        ]
        for child in children:
            bind_as_planned(child, slot)
        tids = [[t.tid for t in read_threads(FS, c.pid)] for c in children]
        total = sum(len(t) for t in tids)
        scanners = [ThreadScanner(FS, c.pid) for c in children]
        matcher = RoleMatcher("workers", ROLES)

        def cycle_scanner() -> None:
            for child, scanner in zip(children, scanners, strict=True):
                obs = observe_process(
                    FS, child.pid, slot, "workers", scanner=scanner, matcher=matcher
                )
                if diff(slot, obs, threshold=0.9):
                    raise AssertionError("steady state should have no drift")

        def cycle_stateless() -> None:
            for child in children:
                obs = observe_process(FS, child.pid, slot, "workers", matcher=matcher)
                diff(slot, obs, threshold=0.9)

        def floor() -> None:
            for per_child in tids:
                for tid in per_child:
                    os.sched_getaffinity(tid)

        floor_s = median_s(floor, repeat)
        scan_s = median_s(cycle_scanner, repeat)
        # A 60-scan window holds one name refresh and six relists.
        scan_mean_s = amortized_s(cycle_scanner, 60, 5)
        few = max(3, repeat // 4)
        syscall_s = median_s(lambda: [read_threads(FS, c.pid, "syscall") for c in children], few)
        status_s = median_s(lambda: [read_threads(FS, c.pid, "status") for c in children], few)
        stateless_s = median_s(cycle_stateless, few)
        sub_s, sub_note = subprocess_cycle_estimate(children, tids, subset)

    print(f"\n== check cycle: {ranks} ranks x {threads} threads = {total} threads ==")
    rows = [
        ("floor: sched_getaffinity per tid", floor_s),
        ("check cycle, ThreadScanner (median)", scan_s),
        ("check cycle, ThreadScanner (amortized)", scan_mean_s),
        ("check cycle, stateless read_threads", stateless_s),
        ("read_threads syscall (comm+affinity)", syscall_s),
        ("read_threads status (parse status)", status_s),
    ]
    for label, seconds in rows:
        print(f"  {label:38s}{fmt_ms(seconds)}  {seconds / floor_s:6.2f}x floor")
    print(f"  {'subprocess: ps -T + taskset -p':38s}{fmt_ms(sub_s)}  {sub_s / floor_s:6.0f}x floor")
    print(f"    {sub_note}")
    per_thread_us = (floor_s / total * 1e6, scan_mean_s / total * 1e6)
    print(f"  per thread: floor {per_thread_us[0]:.2f} us, cycle {per_thread_us[1]:.2f} us")
    floor_ratio = scan_mean_s / floor_s
    speedup = sub_s / scan_mean_s
    ok = floor_ratio <= TARGET_FLOOR_RATIO and speedup >= TARGET_SUBPROCESS_SPEEDUP
    print(
        f"  cycle (amortized)/floor {floor_ratio:.2f}x (target <= {TARGET_FLOOR_RATIO}x), "
        f"subprocess/cycle {speedup:.0f}x (target >= {TARGET_SUBPROCESS_SPEEDUP:.0f}x): "
        + ("MET" if ok else "NOT MET")
    )
    return ok


def subprocess_cycle_estimate(
    children: Sequence[ThreadedChild], tids: Sequence[Sequence[int]], subset: int
) -> tuple[float, str]:
    """Time `ps -T -p PID` for each process and `taskset -p TID` for `subset`
    threads, then extrapolate to every thread (the full run takes minutes)."""
    ps_times: list[float] = []
    for child in children:
        t0 = time.perf_counter()
        subprocess.run(["ps", "-T", "-p", str(child.pid)], capture_output=True, check=True)
        ps_times.append(time.perf_counter() - t0)
    sample = [tid for per_child in tids for tid in per_child][:subset]
    taskset_times: list[float] = []
    for tid in sample:
        t0 = time.perf_counter()
        subprocess.run(["taskset", "-p", str(tid)], capture_output=True, check=True)
        taskset_times.append(time.perf_counter() - t0)
    total_threads = sum(len(t) for t in tids)
    per_taskset = statistics.median(taskset_times)
    estimate = sum(ps_times) + per_taskset * total_threads
    note = (
        f"(ps x{len(children)} timed; taskset timed on {len(sample)} threads,"
        f" {per_taskset * 1e3:.2f} ms each, extrapolated to {total_threads})"
    )
    return estimate, note


def parse_v1_numa_stat_total(text: str) -> dict[int, int]:
    """Pages per node of the `total=` line of a v1 memory.numa_stat, in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    for line in text.splitlines():
        if line.startswith("total="):
            return {
                int(tok[1 : tok.index("=")]): int(tok.split("=")[1]) * page
                for tok in line.split()[1:]
                if tok.startswith("N")
            }
    return {}


def bench_locality(gib: int, repeat: int) -> None:
    if not os.path.isdir("/sys/fs/cgroup/memory") or os.geteuid() != 0:
        print(f"\n== locality read at {gib} GiB: skipped (needs root and a v1 memory cgroup)")
        return
    name = f"check-bench-{os.getpid()}-{gib}g"
    with v1_cgroup(V1_MEMORY, name) as cg:
        # The child joins the cgroup before it allocates, so all its pages are charged there.
        join = f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"'
        with ThreadedChild([], touch_bytes=gib * GIB, wrapper=["sh", "-c", join]) as child:
            pid = child.pid
            stat_rel = f"{str(cg).lstrip('/')}/memory.numa_stat"
            maps_s = median_s(lambda: read_numa_maps(FS, pid), repeat)
            stat_s = median_s(lambda: parse_v1_numa_stat_total(FS.read_text(stat_rel)), repeat)
            maps_bytes = sum(read_numa_maps(FS, pid).values())
            stat_bytes = sum(parse_v1_numa_stat_total(FS.read_text(stat_rel)).values())
    print(f"\n== locality read at {gib} GiB resident ==")
    stat_label = "cgroup memory.numa_stat read+parse"
    print(f"  {stat_label:38s}{fmt_ms(stat_s)}    1.0x  ({stat_bytes / GIB:.2f} GiB)")
    print(
        f"  {'/proc/<pid>/numa_maps read+parse':38s}{fmt_ms(maps_s)}  {maps_s / stat_s:6.1f}x"
        f"  ({maps_bytes / GIB:.2f} GiB)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8x100 only, 1 GiB only")
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--taskset-subset", type=int, default=200)
    args = parser.parse_args(argv)
    if shutil.which("ps") is None or shutil.which("taskset") is None:
        print("ps and taskset are needed for the subprocess baseline", file=sys.stderr)
        return 2
    ok = bench_cycle(8, 100, args.repeat, args.taskset_subset)
    if not args.quick:
        ok = bench_cycle(16, 300, args.repeat, args.taskset_subset) and ok
    bench_locality(1, max(3, args.repeat // 4))
    if not args.quick:
        bench_locality(4, max(3, args.repeat // 4))
    print("\nall cycle targets met" if ok else "\nsome cycle targets NOT met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
