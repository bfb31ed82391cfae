"""`topology` and `plan` cost grows like the host tree, not faster (ratios, never times).

A 1,024-node host took 16.4 s for `topology`: the distance matrix looked each
cell up by a linear scan of its row (nodes³). The input itself grows as nodes²
(one SLIT value per pair), so the check is the cost per input cell, measured
against a smaller host in the same run (tests/bench/scale_bench.py prints it).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions
from supervisor.topology.render import render_topology_text
from tests.bench.scale_bench import many_node_host, measure_sizes, report, scratch_dir

# 128 -> 1,024 nodes: the input grows 64x. Linear cost: about 1x per input
# cell; the old nodes³ rendering: 8x. 3x leaves room for a loaded 2-core box.
MAX_GROWTH_PER_INPUT = 3.0


def test_cost_grows_with_the_input_not_faster() -> None:
    costs = measure_sizes([128, 1024], reps=3)
    small, big = costs
    grow = big.input_cells / small.input_cells
    # Each step on its own: one superlinear step hides in a total that the
    # others dominate at the small size (the old text rendering grew 7x per cell).
    for step in ("discover_s", "text_s", "json_s", "plan_s", "total_s"):
        per_input = getattr(big, step) / getattr(small, step) / grow
        assert per_input < MAX_GROWTH_PER_INPUT, f"{step}: {per_input:.1f}x\n" + report(costs)


def test_a_thousand_nodes_render_every_distance() -> None:
    with tempfile.TemporaryDirectory(dir=scratch_dir()) as tmp:
        root = many_node_host(Path(tmp), 1024)
        topo = read_topology(HostFS(str(root)), DiscoveryOptions())
    lines = render_topology_text(topo).splitlines()
    rows = [line for line in lines if re.match(r"\s*\d+: ", line)]
    assert len(rows) == 1024
    # Row 0: itself 10, its package (256 nodes) 12, the rest 32.
    cells = rows[0].split(":", 1)[1].split()
    assert cells.count("10") == 1 and cells.count("12") == 255 and cells.count("32") == 768
    assert topo.nodes[1000].distance_to(3) == 32 and topo.nodes[1000].distance_to(1023) == 12
