"""Demo worker: a stand-in for one accelerator rank (reads /proc/self, allocates memory).

`python -m supervisor.demo.worker --rank N` first prints where it runs (its
CPUs, memory nodes and memory policy, as the kernel reports them), then
allocates and touches memory in steps up to a cap, runs a `comm` thread
(like an NCCL/HCCL progress thread) and a `release` thread (frees and
re-allocates a chunk now and then), and re-prints its placement periodically
with how its anonymous memory is spread over NUMA nodes.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

from supervisor.hostfs import HostFS
from supervisor.worker import set_thread_name

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20

_NODE_PAGES = re.compile(r"\bN(\d+)=(\d+)")


@dataclass(frozen=True, slots=True)
class SelfPlacement:
    """Where this process runs, as /proc/self says."""

    cpus: str  # Cpus_allowed_list
    mems: str  # Mems_allowed_list
    policy: str  # numa_maps policy of the heap: "bind:0", "prefer:1", "default"
    anon_pages_by_node: dict[int, int]


def parse_status_field(status: str, name: str) -> str:
    for line in status.splitlines():
        key, sep, value = line.partition(":")
        if sep and key == name:
            return value.strip()
    return "?"


def parse_numa_maps(text: str) -> tuple[str, dict[int, int]]:
    """(policy of the anonymous mappings, their pages per node) (pure).

    numa_maps(5) shows each mapping's policy, the task's own for mappings
    without one, so the anonymous and heap lines carry the policy the kernel
    applies to this process's allocations.
    """
    policies: Counter[str] = Counter()
    pages: dict[int, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        if "anon=" not in line and "heap" not in fields:
            continue
        policies[fields[1]] += 1
        for node, count in _NODE_PAGES.findall(line):
            pages[int(node)] = pages.get(int(node), 0) + int(count)
    policy = policies.most_common(1)[0][0] if policies else "unknown"
    return policy, pages


def read_self_placement(fs: HostFS) -> SelfPlacement:
    status = fs.read_text("proc/self/status")
    policy, pages = parse_numa_maps(fs.read_optional("proc/self/numa_maps") or "")
    return SelfPlacement(
        cpus=parse_status_field(status, "Cpus_allowed_list"),
        mems=parse_status_field(status, "Mems_allowed_list"),
        policy=policy,
        anon_pages_by_node=pages,
    )


def placement_line(who: str, fs: HostFS) -> str:
    """`placement rank=0 pid=.. cpus=.. mems=.. policy=..` for the log."""
    p = read_self_placement(fs)
    by_node = ",".join(
        f"N{node}={count * PAGE_BYTES // MIB}MiB"
        for node, count in sorted(p.anon_pages_by_node.items())
    )
    return (
        f"placement {who} pid={os.getpid()} cpus={p.cpus} mems={p.mems}"
        f" policy={p.policy} anon={by_node or '-'}"
    )


def touch(size_bytes: int) -> bytearray:
    """Allocate and write every page, so the memory is really resident."""
    chunk = bytearray(size_bytes)
    # bytearray(n) of a large n is calloc'd from fresh zero pages the kernel
    # has not allocated yet; writing one byte per page makes each one resident
    # (on the node the memory policy picks).
    chunk[::PAGE_BYTES] = b"\x01" * len(range(0, size_bytes, PAGE_BYTES))
    return chunk


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.chunks: list[bytearray] = []
        self.fs = HostFS("/")
        self.who = f"rank={args.rank}"

    def allocated_bytes(self) -> int:
        with self.lock:
            return sum(len(c) for c in self.chunks)

    def comm_loop(self) -> None:
        # An NCCL/HCCL-like progress thread: wake often, do a little work.
        set_thread_name("comm")
        acc = 0
        while not self.stop.wait(0.01):
            acc = (acc * 31 + 7) % 1_000_003
            for i in range(200):
                acc ^= i

    def release_loop(self) -> None:
        # Frees a chunk every few seconds once at the cap; the main loop
        # allocates it again, so pages keep being faulted in under the policy.
        set_thread_name("release")
        while not self.stop.wait(self.args.release_interval_s):
            with self.lock:
                if self.chunks and self.allocated_bytes_unlocked() >= self.cap_bytes():
                    self.chunks.pop(0)

    def allocated_bytes_unlocked(self) -> int:
        return sum(len(c) for c in self.chunks)

    def cap_bytes(self) -> int:
        return int(self.args.mem_cap_mib * MIB)

    def run(self) -> int:
        print(placement_line(self.who, self.fs), flush=True)
        threads = [
            threading.Thread(target=self.comm_loop, name="comm", daemon=True),
            threading.Thread(target=self.release_loop, name="release", daemon=True),
        ]
        for t in threads:
            t.start()
        step = int(self.args.step_mib * MIB)
        next_report = time.monotonic() + self.args.report_interval_s
        while not self.stop.wait(self.args.interval_s):
            if self.allocated_bytes() + step <= self.cap_bytes():
                chunk = touch(step)
                with self.lock:
                    self.chunks.append(chunk)
            if time.monotonic() >= next_report:
                mib = self.allocated_bytes() // MIB
                print(f"{placement_line(self.who, self.fs)} allocated={mib}MiB", flush=True)
                next_report = time.monotonic() + self.args.report_interval_s
        return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m supervisor.demo.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--mem-cap-mib", type=float, default=128.0, help="allocate up to this much")
    p.add_argument("--step-mib", type=float, default=16.0, help="allocate this much per step")
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between steps")
    p.add_argument("--report-interval-s", type=float, default=10.0)
    p.add_argument("--release-interval-s", type=float, default=5.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    worker = Worker(args)

    def on_term(signum: int, _frame: object) -> None:
        worker.stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    code = worker.run()
    print(f"stopped {worker.who} pid={os.getpid()}", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
