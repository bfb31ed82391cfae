"""Page-move benchmark: the check loop's chunked private-page move vs numactl's
`migratepages`, same guest, same boot; and the event loop's cadence during each.

    tests/guest/run-in-vm --nodes 2 -- .venv/bin/python -m tests.bench.migrate_bench [--mib 384]

Runs inside the multi-NUMA test guest (tests/guest/; root). A worker process
touches `--mib` of private anonymous memory on node 0. Each round moves all
of it to node 1, then back to node 0 by the other method, alternating which
goes first:

- ours: `Binder.move_own_pages` as the check loop runs it, in an executor
  thread, one pass's share at a time (`--share-mib`, what migrate_max_bytes_per_s
  x check_interval_s gives a pass: 1 GiB/s x 1 s by default), until none is
  remote; shared pages are left where they are (move_pages(2), MPOL_MF_MOVE);
- numactl: `migratepages PID 0 1` (migrate_pages(2): everything in one call,
  shared pages too as root).

Meanwhile an asyncio loop on this process runs a 10 ms timer, as the daemon's
loop does its checks; the worst lateness of that timer during each move is
printed: a long move must not stall the loop. Prints the move times (median of
`--rounds`), ours/numactl as a ratio, and both loops' worst lateness. Under
TCG the absolute times are 5-20x a real host's: read the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from supervisor.bind.binder import Binder
from supervisor.hostfs import HostFS
from tests.vm_checks.daemon_numa import anon_pages_by_node

WORKER = """
import mmap, sys, time
buf = mmap.mmap(-1, int(sys.argv[1]) << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for at in range(0, len(buf), 4096):
    buf[at] = 1
print("ready", flush=True)
time.sleep(3600)
"""


def pages_on(pid: int, node: int) -> int:
    return anon_pages_by_node(pid)[0].get(node, 0)


def ours(binder: Binder, pid: int, src: int, dst: int, share: int) -> None:
    """Pass after pass, as the check loop does, until nothing is left (or a pass
    moves nothing: what is left cannot move)."""
    for _ in range(1000):
        moved, left = binder.move_own_pages(pid, (src,), dst, share)
        if moved == 0 or left == 0:
            return


def numactl(pid: int, src: int, dst: int) -> None:
    subprocess.run(["migratepages", str(pid), str(src), str(dst)], check=True)


async def timed(fn, *args) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Run `fn(*args)` in an executor thread; (seconds, worst timer lateness)."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst
        while not done:
            at = loop.time()
            await asyncio.sleep(0.01)
            worst = max(worst, loop.time() - at - 0.01)

    tick = asyncio.create_task(ticker())
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        await loop.run_in_executor(pool, fn, *args)
        took = time.monotonic() - start
    done = True
    await tick
    return took, worst


async def main_async(args: argparse.Namespace) -> int:
    if shutil.which("migratepages") is None:
        print("migratepages (numactl) is not installed", file=sys.stderr)
        return 2
    binder = Binder(HostFS("/"))
    share = args.share_mib << 20
    worker = subprocess.Popen(
        # Node 0's CPUs, no memory policy: first touch puts its pages on node 0.
        ["numactl", "--cpunodebind=0", "--", sys.executable, "-c", WORKER, str(args.mib)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        pid = worker.pid
        times: dict[str, list[float]] = {"ours": [], "numactl": []}
        stalls: dict[str, list[float]] = {"ours": [], "numactl": []}
        for round_ in range(args.rounds):
            order = ("ours", "numactl") if round_ % 2 == 0 else ("numactl", "ours")
            src, dst = 0, 1
            for name in order:
                before = pages_on(pid, src)
                if name == "ours":
                    took, worst = await timed(ours, binder, pid, src, dst, share)
                else:
                    took, worst = await timed(numactl, pid, src, dst)
                after = pages_on(pid, dst)
                times[name].append(took)
                stalls[name].append(worst)
                print(
                    f"round {round_} {name:8} {src}->{dst} {before} pages in {took * 1000:.0f} ms, "
                    f"{after} now on {dst}; loop worst lateness {worst * 1000:.1f} ms",
                    flush=True,
                )
                src, dst = dst, src
        t_ours, t_numactl = statistics.median(times["ours"]), statistics.median(times["numactl"])
        print(
            f"move {args.mib} MiB: ours median {t_ours * 1000:.0f} ms "
            f"(share {args.share_mib} MiB a call), numactl migratepages {t_numactl * 1000:.0f} ms; "
            f"ours/numactl = {t_ours / t_numactl:.2f}x"
        )
        print(
            f"loop worst lateness: ours {max(stalls['ours']) * 1000:.1f} ms, "
            f"numactl {max(stalls['numactl']) * 1000:.1f} ms"
        )
        return 0
    finally:
        worker.kill()
        worker.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=384)
    parser.add_argument("--share-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    if os.environ.get("PS_GUEST") != "1":
        print("run inside the test guest: tests/guest/run-in-vm --nodes 2 -- ...", file=sys.stderr)
        return 2
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
