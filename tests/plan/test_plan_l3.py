"""L3-aware shares (issue 27 item 5): ranks that share a node get whole L3
domains (cache/index3/shared_cpu_list) where the counts allow, never one
split between two ranks where a split that avoids it exists; the plan lists
each rank's L3 domains."""

from __future__ import annotations

from pathlib import Path

from supervisor.examples import hosts
from supervisor.hostfs import HostFS
from supervisor.plan.placement import PlanSettings
from supervisor.plan.planner import plan
from supervisor.plan.render import render_plan_table
from supervisor.plan.roles import split_by_l3, split_even
from supervisor.topology.discover import read_topology
from tests.plan.test_plan_ascend import assert_disjoint, plan_process
from tests.support.plan_invariants import check_placement


def ccd_of(cpu: int) -> int:
    """The L3 domain of a CPU on the 8-CCD EPYC: its lowest CPU (8 cores a CCD)."""
    return (cpu % 64) // 8 * 8


def test_l3_domains_are_read(tmp_path: Path) -> None:
    topo = read_topology(HostFS(str(hosts.epyc_nps1_8gpu(tmp_path))))
    assert [c.l3 for c in topo.cpus[:9]] == [0] * 8 + [8]
    assert topo.cpus[64 + 9].l3 == 8  # CPU 73, sibling of 9


def test_epyc_nps1_eight_gpus_each_get_one_ccd(tmp_path: Path) -> None:
    """8 ranks, 8 CCDs on one node: rank r gets CCD r (the engine's 3 cores
    come off the last one); contiguous core shares (main) split 2 CCDs."""
    root = hosts.epyc_nps1_8gpu(tmp_path)
    doc = plan_process(root, None, env_var="CUDA_VISIBLE_DEVICES")
    assert [r["l3_domains"] for r in doc["ranks"]] == [[8 * r] for r in range(8)]
    for r in doc["ranks"]:
        assert {ccd_of(c) for c in r["cpus"]} == {8 * r["rank"]}
    assert doc["ranks"][0]["cpus"] == [*range(8), *range(64, 72)]
    assert len(doc["ranks"][7]["cpus"]) == 10 and doc["engine"]["cpus"] == [
        61,
        62,
        63,
        125,
        126,
        127,
    ]
    assert_disjoint(doc)
    topo = read_topology(HostFS(str(root)))
    p = plan(topo, PlanSettings())
    check_placement(topo, p)
    # What main did: the same 61 cores in even contiguous shares.
    view_cores = sorted({tuple(sorted(c.siblings)) for c in topo.cpus})[:61]
    old = split_even(view_cores, 8)
    split = sum(1 for s in old if len({ccd_of(core[0]) for core in s}) > 1)
    assert split == 2  # ranks 5/6 share CCD 5 (40-47), ranks 6/7 CCD 6


def test_fewer_ccds_than_ranks_never_spans_two(tmp_path: Path) -> None:
    """4 CCDs of 16 cores, 8 ranks: two ranks per CCD, none across two."""
    topo = read_topology(HostFS(str(hosts.epyc_nps1_8gpu(tmp_path, ccds=4))))
    p = plan(topo, PlanSettings())
    for r in p.ranks:
        assert len(r.l3_domains) == 1
    assert [r.l3_domains[0] for r in p.ranks] == [0, 0, 16, 16, 32, 32, 48, 48]
    check_placement(topo, p)


def test_split_by_l3_falls_back_where_unknown_or_single() -> None:
    cores = [(i,) for i in range(8)]
    assert split_by_l3(cores, 2, {}) == split_even(cores, 2)
    assert split_by_l3(cores, 2, dict.fromkeys(range(8), 0)) == split_even(cores, 2)
    # 3 domains of sizes 2, 3, 3 for 3 ranks: one domain each (not 3, 3, 2).
    l3 = {0: 0, 1: 0, 2: 2, 3: 2, 4: 2, 5: 5, 6: 5, 7: 5}
    assert split_by_l3(cores, 3, l3) == [[(0,), (1,)], [(2,), (3,), (4,)], [(5,), (6,), (7,)]]


def test_hosts_without_cache_files_plan_as_before(tmp_path: Path) -> None:
    topo = read_topology(HostFS(str(hosts.dgx_h100(tmp_path))))
    p = plan(topo, PlanSettings())
    assert all(r.l3_domains == () for r in p.ranks)
    assert "l3_domains" not in p.to_doc()["ranks"][0]


def test_plan_table_has_an_l3_column_only_where_known(tmp_path: Path) -> None:
    topo = read_topology(HostFS(str(hosts.epyc_nps1_8gpu(tmp_path))))
    lines = render_plan_table(plan(topo, PlanSettings()), topo).splitlines()
    header = lines[1].split()
    assert "l3" in header and lines[2].split()[header.index("l3")] == "0"
    topo = read_topology(HostFS(str(hosts.dgx_h100(tmp_path))))
    assert "l3" not in render_plan_table(plan(topo, PlanSettings()), topo).splitlines()[1].split()
