"""Discovery + plan vs `lscpu --sysroot TREE -e` on the same fixture trees, same run.

Run: `.venv/bin/python -m tests.bench.discovery_bench [--reps N]`. Prints
medians and the ratio ours/lscpu for the 640-CPU Ascend A3 tree and the
224-CPU DGX H100 tree. lscpu is what peers shell out to for the CPU/node
table; we read that plus cgroups, PCI, accelerators, NICs and IRQs, and plan.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from supervisor.cpulist import format_mask, parse_cpulist
from supervisor.examples.hosts import ascend_a3, dgx_h100
from supervisor.hostfs import HostFS
from supervisor.plan.placement import PlanSettings
from supervisor.plan.planner import plan
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions

# lscpu (util-linux 2.38) wants these besides what discovery reads: the hex
# sibling masks (it probes topology/thread_siblings before reading a CPU's
# topology) and /proc/cpuinfo. They are added to the bench's copy only, in
# the kernel's formats, derived from the *_list files FakeHost wrote.
MASK_FROM_LIST = {
    "thread_siblings": "thread_siblings_list",
    "core_cpus": "core_cpus_list",
    "core_siblings": "package_cpus_list",
    "package_cpus": "package_cpus_list",
}


def add_lscpu_files(root: Path) -> None:
    cpu_dir = root / "sys/devices/system/cpu"
    online = sorted(parse_cpulist((cpu_dir / "online").read_text()))
    for cpu in online:
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        for mask, listed in MASK_FROM_LIST.items():
            source = topo / listed
            if source.exists() and not (topo / mask).exists():
                (topo / mask).write_text(format_mask(parse_cpulist(source.read_text())) + "\n")
    lines = []
    for cpu in online:
        core = (cpu_dir / f"cpu{cpu}/topology/core_id").read_text().strip()
        package = (cpu_dir / f"cpu{cpu}/topology/physical_package_id").read_text().strip()
        lines.append(
            f"processor\t: {cpu}\nphysical id\t: {package}\ncore id\t\t: {core}\n"
            "BogoMIPS\t: 100.00\n\n"
        )
    (root / "proc/cpuinfo").write_text("".join(lines))


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm the page cache and imports
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_host(name: str, root: Path, reps: int, lscpu: str) -> None:
    options = DiscoveryOptions()
    settings = PlanSettings()

    def ours() -> object:
        return plan(read_topology(HostFS(str(root)), options), settings)

    def discovery_only() -> object:
        return read_topology(HostFS(str(root)), options)

    topology = read_topology(HostFS(str(root)), options)

    def plan_only() -> object:
        return plan(topology, settings)

    def shell_out() -> object:
        return subprocess.run(
            [lscpu, "--sysroot", str(root), "-e"], check=True, capture_output=True
        )

    recorder = HostFS(str(root), record=True)
    read_topology(recorder, options)
    assert recorder.log is not None
    files = len(recorder.log.files)
    rows = len(shell_out().stdout.splitlines()) - 1  # type: ignore[attr-defined]

    ours_s = median_s(ours, reps)
    disc_s = median_s(discovery_only, reps)
    plan_s = median_s(plan_only, reps)
    lscpu_s = median_s(shell_out, reps)
    print(
        f"== {name}: {len(topology.cpus)} CPUs, {len(topology.nodes)} nodes, "
        f"{len(topology.devices)} devices, {len(topology.irqs)} IRQs; reps={reps}"
    )
    print(f"  ours: discovery + plan      {ours_s * 1e3:8.2f} ms  ({files} files read)")
    print(f"        discovery alone       {disc_s * 1e3:8.2f} ms")
    print(f"        plan alone            {plan_s * 1e3:8.2f} ms")
    print(f"  lscpu --sysroot -e (spawn)  {lscpu_s * 1e3:8.2f} ms  ({rows} CPU rows)")
    print(f"  ratio ours/lscpu            {ours_s / lscpu_s:8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    lscpu = shutil.which("lscpu")
    if lscpu is None:
        print("lscpu not found (util-linux); nothing to compare against", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="discovery-bench-") as tmp:
        for name, build in (("ascend_a3 (640 CPUs)", ascend_a3), ("dgx_h100 (224 CPUs)", dgx_h100)):
            root = build(Path(tmp))
            add_lscpu_files(root)
            bench_host(name, root, args.reps, lscpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
