"""Host-to-device and device-to-host copy bandwidth: pinned buffers on the GPU's node vs another.

    .venv/bin/python -m tests.bench.h2d_bench [--device 0] [--mib 1024] [--rounds 5]

Needs torch with CUDA and a host with two NUMA nodes or more; otherwise it
says why and exits 0 (skipped). The GPU's node comes from the supervisor's
own discovery (`read_topology`, the sysfs `numa_node` of its PCI function).
Each measurement runs in a child that places itself with the supervisor's
own binding calls, as the shim places a rank before exec: sched_setaffinity
to the node's CPUs and set_mempolicy(MPOL_BIND) to the node, then allocates
`torch.empty(..., pin_memory=True)` (cudaHostAlloc: the pages are allocated
and locked under that policy), checks with move_pages(2) where the pages
are, and times `copy_(non_blocking=True)` both ways with CUDA events.
Children alternate local and remote, round by round; prints GiB/s medians
and local/remote per direction. The published anchor: about 33 vs 13.5 GiB/s
on a DGX H100 (openxla/xla#21708). Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from supervisor.bind.syscalls import MPOL_BIND, move_pages, set_mempolicy
from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions

GIB = 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")
VISIBILITY = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def child(node: int, cpus: list[int], device: int, mib: int, iters: int) -> dict[str, Any]:
    """Bind this process to `node`, pin `mib` MiB there, time copies both ways."""
    os.sched_setaffinity(0, cpus)
    set_mempolicy(MPOL_BIND, [node])
    import torch  # noqa: PLC0415 - after the binding: CUDA's own host memory lands there too

    torch.cuda.set_device(device)
    size = mib << 20
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
    base = host.data_ptr()
    where = move_pages(0, range(base, base + size, 1 << 20))
    local = sum(1 for n in where if n == node) / len(where)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out: dict[str, Any] = {"node": node, "pages_on_node": local}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        for _ in range(3):  # warm-up
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates = []
        for _ in range(iters):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rates.append(size / GIB / (start.elapsed_time(end) / 1e3))
        out[name] = statistics.median(rates)
    return out


def gpu_node(device: int) -> tuple[int | None, str]:
    env = tuple((k, os.environ[k]) for k in VISIBILITY if k in os.environ)
    topo = read_topology(HostFS("/"), DiscoveryOptions(accelerator="nvidia", env=env))
    gpus = [d for d in topo.devices if d.kind == "nvidia" and d.visible]
    gpus.sort(key=lambda d: d.index if d.ordinal is None else d.ordinal)
    if device >= len(gpus):
        return None, f"no NVIDIA device {device} (found {len(gpus)})"
    return gpus[device].numa_node, gpus[device].bdf or "?"


def run_child(args: argparse.Namespace, node: int, cpus: list[int]) -> dict[str, Any]:
    argv = [sys.executable, "-m", "tests.bench.h2d_bench", "--child", str(node)]
    argv += ["--cpus", ",".join(map(str, cpus)), "--device", str(args.device)]
    argv += ["--mib", str(args.mib), "--iters", str(args.iters)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child on node {node} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        cpus = [int(c) for c in args.cpus.split(",")]
        print(json.dumps(child(args.child, cpus, args.device, args.mib, args.iters)))
        return 0
    try:
        import torch  # noqa: PLC0415

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        print("h2d bench: skipped, no CUDA device (torch.cuda.is_available() is False)")
        return 0
    node, bdf = gpu_node(args.device)
    topo = read_topology(HostFS("/"))
    with_cpus = {n.id: sorted(n.cpus & topo.allowed.cpus) for n in topo.nodes}
    with_cpus = {n: c for n, c in with_cpus.items() if c}
    if node is None or node not in with_cpus:
        node = min(with_cpus)  # unknown, or a CPU-less (HBM) node: its nearest is not ours to guess
        print(
            f"GPU {args.device} ({bdf}): node unknown or without CPUs, comparing from node {node}"
        )
    others = sorted(n for n in with_cpus if n != node)
    if not others:
        print("h2d bench: skipped, one NUMA node with CPUs: nothing to compare")
        return 0
    # The remote node: the farthest by SLIT distance, as a misplaced rank's would be.
    distance = dict(next(n for n in topo.nodes if n.id == node).distances)
    remote = max(others, key=lambda n: (distance.get(n, 0), -n))
    results: dict[int, list[dict[str, Any]]] = {node: [], remote: []}
    for r in range(args.rounds):
        for n in (node, remote) if r % 2 == 0 else (remote, node):
            results[n].append(run_child(args, n, with_cpus[n]))
    print(f"GPU {args.device} ({bdf}) on node {node}; remote node {remote}; {args.mib} MiB pinned")
    print(f"{'':<8} {'local GiB/s':>12} {'remote GiB/s':>13} {'local/remote':>13}")
    for name in ("h2d", "d2h"):
        here = statistics.median(x[name] for x in results[node])
        there = statistics.median(x[name] for x in results[remote])
        print(f"{name:<8} {here:12.1f} {there:13.1f} {here / there:13.2f}")
    pages = {n: min(x["pages_on_node"] for x in v) for n, v in results.items()}
    print(f"pinned pages on the bound node (lowest of {args.rounds}): {pages}")
    print("anchor: 33 vs 13.5 GiB/s (2.44x) on a DGX H100, openxla/xla#21708")
    return 0


if __name__ == "__main__":
    sys.exit(main())
