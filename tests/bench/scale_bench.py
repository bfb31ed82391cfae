"""How `topology` and `plan` cost grows with the number of NUMA nodes (64, 256, 1024).

Run: `.venv/bin/python -m tests.bench.scale_bench [--nodes 64 256 1024] [--reps N]`.
Writes one fake host tree per size (one CPU per node, SLIT rows of every node),
then times, in this process, discovery + the `topology` text + `topology
--json` + the default plan. Prints each size's time as a ratio against the
smallest size measured in the same run, next to the ratio of the input itself:
a node's distance row holds a value per node, so the tree grows as nodes².
Cost that grows like the input is linear; the quadratic lookups this replaced
grew as nodes³ (1,024 nodes: 16.4 s). Absolute times are printed for reading
only; `tests/topology/test_topology_scale.py` asserts on the ratios.

Does I/O: writes the trees in a temporary directory (tmpfs when there is one).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.cli import dump_json
from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from supervisor.plan.placement import PlanSettings
from supervisor.plan.planner import plan
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions
from supervisor.topology.render import render_topology_text, topology_to_doc

SIZES = (64, 256, 1024)
SOCKETS = 4  # nodes split evenly over this many packages (12 within, 32 across)


def many_node_host(root: Path, nodes: int) -> Path:
    """A host of `nodes` NUMA nodes, one CPU each, over SOCKETS packages."""
    sockets = SOCKETS if nodes % SOCKETS == 0 else 1
    per_socket = nodes // sockets
    rows = [
        [10 if a == b else 12 if a // per_socket == b // per_socket else 32 for b in range(nodes)]
        for a in range(nodes)
    ]
    # old_topology(): the four topology files per CPU that old kernels have;
    # the node files, which are what grows here, are all written.
    host = FakeHost(root).cpus(sockets, per_socket, 1, nodes_per_socket=per_socket)
    return host.old_topology().distances(rows).build()


def scratch_dir() -> str | None:
    """tmpfs when writable (writing 10,000 small files to disk dominates otherwise)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


@dataclass(frozen=True, slots=True)
class Cost:
    nodes: int
    input_cells: int  # distance values + CPUs: what discovery has to read
    discover_s: float
    text_s: float
    json_s: float
    plan_s: float

    @property
    def total_s(self) -> float:
        return self.discover_s + self.text_s + self.json_s + self.plan_s


def _best_of(reps: int, fn: object) -> tuple[float, object]:
    assert callable(fn)
    best = float("inf")
    result: object = None
    for _ in range(reps):
        start = time.process_time()
        result = fn()
        best = min(best, time.process_time() - start)
    return best, result


def measure(root: Path, nodes: int, reps: int) -> Cost:
    """The fastest of `reps` runs of each step (the least disturbed by other load)."""
    options = DiscoveryOptions()
    discover_s, topo = _best_of(reps, lambda: read_topology(HostFS(str(root)), options))
    from supervisor.topology.model import Topology  # noqa: PLC0415 - typing the result

    assert isinstance(topo, Topology) and len(topo.nodes) == nodes
    text_s, _ = _best_of(reps, lambda: render_topology_text(topo))
    json_s, _ = _best_of(reps, lambda: dump_json(topology_to_doc(topo)))
    plan_s, _ = _best_of(reps, lambda: plan(topo, PlanSettings()))
    return Cost(nodes, nodes * nodes + len(topo.cpus), discover_s, text_s, json_s, plan_s)


def measure_sizes(sizes: Sequence[int], reps: int) -> list[Cost]:
    with tempfile.TemporaryDirectory(prefix="scale-bench-", dir=scratch_dir()) as tmp:
        costs = []
        for n in sizes:
            root = many_node_host(Path(tmp) / f"n{n}", n)
            costs.append(measure(root, n, reps))
        return costs


def report(costs: Sequence[Cost]) -> str:
    base = costs[0]
    lines = [
        f"baseline: {base.nodes} nodes, measured in this run; ratios are time / baseline time",
        f"{'nodes':>6} {'input':>7} {'total':>7} {'discover':>9} {'text':>7} {'json':>7} "
        f"{'plan':>7} {'per input':>10}   (total ms)",
    ]
    for c in costs:
        grow = c.input_cells / base.input_cells
        total = c.total_s / base.total_s
        lines.append(
            f"{c.nodes:>6} {grow:>6.1f}x {total:>6.1f}x {c.discover_s / base.discover_s:>8.1f}x "
            f"{c.text_s / base.text_s:>6.1f}x {c.json_s / base.json_s:>6.1f}x "
            f"{c.plan_s / base.plan_s:>6.1f}x {total / grow:>9.2f}x   ({c.total_s * 1e3:.0f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    print(report(measure_sizes(args.nodes, args.reps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
