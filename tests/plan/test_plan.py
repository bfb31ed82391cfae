"""The planner on Topology objects built in memory: strategies, roles, engine,
shortage handling, errors, and the docs/contracts.md §3 invariants over generated hosts."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from supervisor.errors import PlanError
from supervisor.plan.placement import Placement, PlanSettings
from supervisor.plan.planner import plan
from supervisor.topology.model import Topology
from tests.support.plan_invariants import check_placement
from tests.support.plan_topology import build_topology, dev, topologies

NO_ENGINE = PlanSettings(engine=False)


def cpus_of(placement: Placement, rank: int) -> set[int]:
    return set(placement.rank(rank).slot.cpus)


def nodes_of(topology: Topology, cpus: set[int]) -> set[int]:
    return {topology.cpu(c).node for c in cpus}


# -- numa-affine ---------------------------------------------------------------


def test_two_socket_eight_gpus_each_socket_split_in_four() -> None:
    topo = build_topology([28, 28], threads_per_core=2, devices=[dev(i, i // 4) for i in range(8)])
    p = plan(topo, PlanSettings())
    check_placement(topo, p)
    assert p.strategy == "numa-affine"
    for r in range(4):
        assert nodes_of(topo, cpus_of(p, r)) == {0}
        assert p.rank(r).slot.mems == (0,)
    for r in range(4, 8):
        assert nodes_of(topo, cpus_of(p, r)) == {1}
    # Engine: so_compiler 4 CPUs = 2 cores, main 2 CPUs = 1 core, from node 0's end.
    assert p.engine is not None
    assert p.engine.roles["so_compiler"] == (26, 27, 82, 83)
    assert p.engine.roles["main"] == (25, 81)
    assert p.engine.mems == (0,)
    # node 0 keeps 25 cores for 4 GPUs: 7+6+6+6, earlier GPUs get the extra core.
    assert [len(cpus_of(p, r)) for r in range(4)] == [14, 12, 12, 12]
    # node 1 has no engine: 28 cores / 4 = 7 each.
    assert [len(cpus_of(p, r)) for r in range(4, 8)] == [14] * 4


def test_roles_irq_first_comm_last_whole_cores_on_smt() -> None:
    topo = build_topology([8], threads_per_core=2, devices=[dev(0, 0)])
    p = plan(topo, NO_ENGINE)
    roles = p.rank(0).slot.roles
    # Intel numbering: core k = CPUs k and k+8. A 1-CPU role takes a whole core.
    assert roles["irq"] == (0, 8)
    assert roles["comm"] == (7, 15)
    assert roles["main"] == (1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14)


def test_adjacent_smt_numbering_keeps_siblings_together() -> None:
    topo = build_topology([8], threads_per_core=2, smt="adjacent", devices=[dev(0, 0), dev(1, 0)])
    p = plan(topo, NO_ENGINE)
    check_placement(topo, p)
    assert p.rank(0).slot.cpus == tuple(range(8))
    assert p.rank(0).slot.roles["irq"] == (0, 1)
    assert p.rank(1).slot.cpus == tuple(range(8, 16))


def test_gpus_on_a_high_node_id_get_that_nodes_cpus() -> None:
    # EPYC NPS4-like: GPU0/1 on node 3, GPU2/3 on node 2, GPU4/5 on node 1, GPU6/7 on node 0.
    topo = build_topology([8, 8, 8, 8], devices=[dev(i, 3 - i // 2) for i in range(8)])
    p = plan(topo, NO_ENGINE)
    check_placement(topo, p)
    assert nodes_of(topo, cpus_of(p, 0) | cpus_of(p, 1)) == {3}
    assert p.rank(0).slot.mems == (3,)
    assert cpus_of(p, 0) == set(range(24, 28))


def test_cpu_less_hbm_nodes_use_nearest_cpu_node_for_cpus_and_mems() -> None:
    # Grace-Blackwell-like: nodes 0,1 have CPUs; nodes 2,3 (GPU0/1 HBM) near 0,
    # nodes 4,5 (GPU2/3 HBM) near 1.
    dist = [
        [10, 40, 80, 80, 120, 120],
        [40, 10, 120, 120, 80, 80],
        [80, 120, 10, 120, 120, 120],
        [80, 120, 120, 10, 120, 120],
        [120, 80, 120, 120, 10, 120],
        [120, 80, 120, 120, 120, 10],
    ]
    topo = build_topology(
        [16, 16, 0, 0, 0, 0],
        devices=[dev(0, 2), dev(1, 3), dev(2, 4), dev(3, 5)],
        distances=dist,
    )
    p = plan(topo, PlanSettings())
    check_placement(topo, p)
    assert nodes_of(topo, cpus_of(p, 0) | cpus_of(p, 1)) == {0}
    assert nodes_of(topo, cpus_of(p, 2) | cpus_of(p, 3)) == {1}
    assert [r.slot.mems for r in p.ranks] == [(0,), (0,), (1,), (1,)]
    assert p.engine is not None and p.engine.mems == (0,)


def test_five_and_three_gpus_split_their_own_socket() -> None:
    topo = build_topology([32, 32], devices=[dev(i, 0 if i < 5 else 1) for i in range(8)])
    p = plan(topo, NO_ENGINE)
    check_placement(topo, p)
    assert [len(cpus_of(p, r)) for r in range(5)] == [7, 7, 6, 6, 6]
    assert [len(cpus_of(p, r)) for r in range(5, 8)] == [11, 11, 10]
    assert all(nodes_of(topo, cpus_of(p, r)) == {0} for r in range(5))
    assert all(nodes_of(topo, cpus_of(p, r)) == {1} for r in range(5, 8))


def test_container_cpuset_with_holes_stays_inside() -> None:
    allowed = {c for c in range(64) if c % 32 not in (3, 4, 17)} - {40}
    topo = build_topology(
        [16, 16],
        threads_per_core=2,
        devices=[dev(i, i // 2) for i in range(4)],
        allowed_cpus=allowed,
    )
    p = plan(topo, PlanSettings(on_shortage="merge"))
    check_placement(topo, p)
    used = set().union(*(set(r.slot.cpus) for r in p.ranks))
    assert used <= allowed


def test_allowed_mems_exclude_device_node_use_nearest_allowed_with_warning() -> None:
    topo = build_topology([8, 8], devices=[dev(0, 1)], allowed_mems=[0])
    p = plan(topo, NO_ENGINE)
    check_placement(topo, p)
    assert p.rank(0).slot.mems == (0,)
    assert any("not allowed" in w and "node 0" in w for w in p.warnings)


# -- hidden devices and global slicing ----------------------------------------


def _hidden_except(topo: Topology, visible: Sequence[int] | set[int]) -> Topology:
    """Only `visible` shown, in that order (a set: index order), as a visibility
    list would show them."""
    order = sorted(visible) if isinstance(visible, set) else list(visible)
    devices = tuple(
        dataclasses.replace(
            d,
            visible=d.index in order,
            ordinal=order.index(d.index) if d.index in order else None,
        )
        for d in topo.devices
    )
    return dataclasses.replace(topo, devices=devices)


def test_hidden_devices_on_the_same_node_keep_their_share() -> None:
    base = build_topology([24], devices=[dev(0, 0), dev(1, 0)])
    a = plan(_hidden_except(base, {0}), NO_ENGINE)
    b = plan(_hidden_except(base, {1}), NO_ENGINE)
    assert a.rank(0).slot.cpus == tuple(range(12))
    assert b.rank(0).slot.cpus == tuple(range(12, 24))
    # Without the reservation both take the whole node: the overlap #8600 hit.
    no_res = PlanSettings(engine=False, reserve_hidden=False)
    a2 = plan(_hidden_except(base, {0}), no_res)
    b2 = plan(_hidden_except(base, {1}), no_res)
    assert set(a2.rank(0).slot.cpus) & set(b2.rank(0).slot.cpus)


def test_global_slice_matches_vllm_ascend_a3_layout() -> None:
    topo = build_topology(
        [160, 160, 160, 160], devices=[dev(i, None, kind="ascend") for i in range(16)]
    )
    p = plan(topo, NO_ENGINE)
    check_placement(topo, p)
    assert p.strategy == "global-slice"
    for r in p.ranks:
        assert r.slot.cpus == tuple(range(40 * r.rank, 40 * r.rank + 40))
        assert r.slot.roles["irq"] == (40 * r.rank,)
        assert r.slot.roles["comm"] == (40 * r.rank + 39,)
    assert len(p.warnings) == 1 and "ascend0" in p.warnings[0] and "ascend15" in p.warnings[0]
    # With the engine it comes out of rank 0's own slice: other slices unchanged.
    q = plan(topo, PlanSettings())
    assert q.engine is not None and q.engine.cpus == tuple(range(34, 40))
    assert q.rank(0).slot.cpus == tuple(range(34))
    assert all(q.rank(r).slot.cpus == p.rank(r).slot.cpus for r in range(1, 16))


def test_global_slice_two_supervisors_sharing_a_cpuset_never_overlap() -> None:
    base = build_topology([10, 10], devices=[dev(i, i % 2) for i in range(5)])
    gs = PlanSettings(strategy="global-slice", engine=False, on_shortage="merge")
    a = plan(_hidden_except(base, {0, 3}), gs)
    b = plan(_hidden_except(base, {1, 2, 4}), gs)
    a_cpus = set().union(*(set(r.slot.cpus) for r in a.ranks))
    b_cpus = set().union(*(set(r.slot.cpus) for r in b.ranks))
    assert not a_cpus & b_cpus
    # 20 cores over 5 devices: device 3 gets cores 12-15 whatever else is visible.
    assert a.rank(1).slot.cpus == (12, 13, 14, 15)


def test_auto_mixes_when_some_locality_is_unknown() -> None:
    topo = build_topology([16, 16], devices=[dev(0, 0), dev(1, 0), dev(2, 1), dev(3, None)])
    p = plan(topo, PlanSettings())
    check_placement(topo, p)
    assert p.strategy == "mixed"
    assert [r.strategy for r in p.ranks] == ["numa-affine"] * 3 + ["global-slice"]
    assert any("nvidia3" in w and "global-slice" in w for w in p.warnings)


def test_forced_numa_affine_refuses_unknown_locality() -> None:
    topo = build_topology([8], devices=[dev(0, None)])
    with pytest.raises(PlanError, match=r"nvidia0 .* has no known NUMA node"):
        plan(topo, PlanSettings(strategy="numa-affine"))


# -- ranks ------------------------------------------------------------------


def test_devices_per_rank_groups_consecutive_devices() -> None:
    topo = build_topology([16, 16], devices=[dev(i, i // 2) for i in range(4)])
    p = plan(topo, PlanSettings(engine=False, devices_per_rank=2))
    check_placement(topo, p)
    assert len(p.ranks) == 2
    assert [d.index for d in p.rank(1).all_devices] == [2, 3]
    assert nodes_of(topo, cpus_of(p, 1)) == {1}
    assert p.rank(1).to_doc()["devices"][1]["index"] == 3
    with pytest.raises(PlanError, match=r"devices_per_rank = 3 does not divide the 4 visible"):
        plan(topo, PlanSettings(devices_per_rank=3))


def test_no_visible_device_names_what_was_found() -> None:
    topo = build_topology([8], devices=[dev(0, 0, visible=False), dev(1, 0, visible=False)])
    with pytest.raises(PlanError, match=r"no visible accelerator: found nvidia0, nvidia1"):
        plan(topo, PlanSettings())


def test_no_allowed_cpus_is_a_plan_error() -> None:
    topo = build_topology([8], devices=[dev(0, 0)], allowed_cpus=[])
    with pytest.raises(PlanError, match="no allowed CPUs"):
        plan(topo, PlanSettings())


# -- shortage ---------------------------------------------------------------


def test_shortage_error_names_the_numbers() -> None:
    topo = build_topology([8, 4], devices=[dev(0, 0), dev(1, 1), dev(2, 1)])
    with pytest.raises(PlanError) as info:
        plan(topo, NO_ENGINE)
    assert str(info.value) == (
        "rank 1 (nvidia1 on node 1) gets 2 CPUs but needs 3 CPUs: irq 1 + comm 1 + main >= 1; "
        "allowed CPUs on node 1: 4 for 2 devices"
    )


def test_shortage_merge_folds_roles_into_main_with_a_warning() -> None:
    topo = build_topology([8, 4], devices=[dev(0, 0), dev(1, 1), dev(2, 1)])
    p = plan(topo, PlanSettings(engine=False, on_shortage="merge"))
    check_placement(topo, p)
    assert dict(p.rank(2).slot.roles) == {"main": (10, 11)}
    assert set(p.rank(0).slot.roles) == {"irq", "main", "comm"}
    assert any(w.startswith("rank 2 (nvidia2)") and "merged" in w for w in p.warnings)
    assert not p.shared


def test_engine_gives_way_to_the_ranks_with_a_warning() -> None:
    # 4 CPUs, one GPU: the full engine (6 CPUs) cannot fit; merged (2) would
    # leave the rank 2 < 3; one core leaves it 3: irq, main, comm.
    topo = build_topology([4], devices=[dev(0, 0)])
    p = plan(topo, PlanSettings())
    check_placement(topo, p)
    assert p.engine is not None and dict(p.engine.roles) == {"main": (3,)}
    assert p.rank(0).slot.cpus == (0, 1, 2)
    assert any(w.startswith("engine: node 0") and "merged into main" in w for w in p.warnings)


def test_engine_shortage_in_error_mode_names_the_numbers() -> None:
    with pytest.raises(PlanError) as info:
        plan(build_topology([3], devices=[dev(0, 0)]), PlanSettings())
    assert str(info.value) == (
        "rank 0 (nvidia0 on node 0) gets 2 CPUs but needs 3 CPUs: irq 1 + comm 1 + main >= 1; "
        "allowed CPUs on node 0: 3, 1 to the engine, 2 for 1 devices"
    )
    with pytest.raises(PlanError, match=r"engine needs a core of its own on node 0 .* 1 allowed"):
        plan(build_topology([1], devices=[dev(0, 0)]), PlanSettings())


def test_two_cpu_demo_box_shares_and_says_so() -> None:
    topo = build_topology([2], devices=[dev(0, 0, kind="cpu"), dev(1, 0, kind="cpu")])
    p = plan(topo, PlanSettings())  # on_shortage None -> share on a CPU-only host
    check_placement(topo, p)
    assert p.shared
    assert p.engine is not None
    assert any("CPU 1 by rank 1 and engine" in w for w in p.warnings)
    # The engine overlays the node but keeps its compiler pool on a CPU of
    # its own role, so the demo shows so_compiler threads apart from main.
    assert p.engine.cpus == (0, 1)
    assert p.engine.roles == {"main": (0,), "so_compiler": (1,)}


def test_one_cpu_box_puts_everything_on_cpu_0() -> None:
    topo = build_topology([1], devices=[dev(i, 0, kind="cpu") for i in range(3)])
    p = plan(topo, PlanSettings())
    check_placement(topo, p)
    assert all(r.slot.cpus == (0,) for r in p.ranks)
    assert p.engine is not None and p.engine.cpus == (0,)


def test_engine_disabled_gives_no_engine_slot() -> None:
    topo = build_topology([8], devices=[dev(0, 0)])
    assert plan(topo, NO_ENGINE).engine is None
    assert plan(topo, NO_ENGINE).to_doc()["engine"] is None


def test_plan_document_round_trips() -> None:
    topo = build_topology([16, 16], devices=[dev(i, i // 2) for i in range(4)])
    p = plan(topo, PlanSettings())
    assert Placement.from_doc(p.to_doc()) == p


# -- properties over generated hosts -------------------------------------------


plan_settings = st.builds(
    PlanSettings,
    strategy=st.sampled_from(["auto", "auto", "numa-affine", "global-slice"]),
    engine=st.booleans(),
    reserve_hidden=st.booleans(),
    on_shortage=st.sampled_from([None, "error", "merge", "share", "share"]),
    devices_per_rank=st.sampled_from([1, 1, 1, 2]),
    rank_roles=st.sampled_from([{"irq": 1, "comm": 1}, {}, {"irq": 2, "acl": 1, "rel": 1}]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topologies(), plan_settings, st.randoms(use_true_random=False))
def test_every_plan_keeps_the_invariants(
    topo: Topology, s: PlanSettings, rnd: random.Random
) -> None:
    failure: str | None = None
    try:
        p = plan(topo, s)
    except PlanError as err:
        failure = str(err)
    if failure is not None:
        event(f"PlanError: {failure.split(':')[0][:30]}")
        # Only an infeasible request may fail: "share" with auto and one device
        # per rank always finds a plan when some allowed memory node has CPUs.
        mems_ok = not topo.allowed.mems or any(topo.node(n).cpus for n in topo.allowed.mems)
        always = s.on_shortage == "share" and s.strategy != "numa-affine"
        assert not (always and s.devices_per_rank == 1 and mems_ok), f"share failed: {failure}"
        return
    event(f"planned {p.strategy}{' shared' if p.shared else ''}")
    check_placement(topo, p)
    assert plan(topo, s) == p
    shuffled = list(topo.devices)
    rnd.shuffle(shuffled)
    assert plan(dataclasses.replace(topo, devices=tuple(shuffled)), s) == p
    if s.on_shortage in ("error", "merge"):
        assert not p.shared


@settings(max_examples=200, deadline=None)
@given(topologies(kind="nvidia"), st.sampled_from(["auto", "global-slice"]), st.data())
def test_two_supervisors_seeing_disjoint_devices_never_overlap(
    topo: Topology, strategy: str, data: st.DataObject
) -> None:
    indices = [d.index for d in topo.devices]
    mine = set(data.draw(st.sets(st.sampled_from(indices), min_size=1)))
    theirs = set(indices) - mine
    if not theirs:
        return
    # Each supervisor lists its devices in any order: ranks follow the list,
    # shares and slices the host's device order, so they still never overlap.
    mine_listed = data.draw(st.permutations(sorted(mine)))
    theirs_listed = data.draw(st.permutations(sorted(theirs)))
    s = PlanSettings(strategy=strategy, engine=False, on_shortage="merge")  # type: ignore[arg-type]
    try:
        a = plan(_hidden_except(topo, mine_listed), s)
        b = plan(_hidden_except(topo, theirs_listed), s)
    except PlanError:
        event("PlanError")
        return
    if any("hidden devices' shares dropped" in w for w in (*a.warnings, *b.warnings)):
        # Too few CPUs for every device's share: one plan beats none, and says so.
        event("hidden shares dropped")
        return
    if any("(they may overlap with this one)" in w for w in (*a.warnings, *b.warnings)):
        # A device whose own node has no allowed CPU: folded for its own
        # supervisor, no share elsewhere (issue 27 item 3), and said so.
        event("device outside its node")
        return
    event("both planned")
    a_cpus = set().union(*(set(r.slot.cpus) for r in a.ranks))
    b_cpus = set().union(*(set(r.slot.cpus) for r in b.ranks))
    assert not a_cpus & b_cpus, (a.to_doc(), b.to_doc())


OVERLAP_SAID = ("hidden devices' shares dropped", "(they may overlap with this one)", "share CPU")


@settings(max_examples=500, deadline=None)
@given(
    topologies(kind="nvidia"),
    st.sampled_from(["supervisor", "global_slice"]),
    st.integers(2, 3),
    st.data(),
)
def test_any_number_of_supervisors_never_overlap_engines_included(
    topo: Topology, allocator: str, count: int, data: st.DataObject
) -> None:
    """Issue 27 item 3: supervisors on one cpuset, each seeing some devices and
    running an engine, share no CPU, ranks or engines, unless a plan says why."""
    indices = [d.index for d in topo.devices]
    owner = [data.draw(st.integers(0, count - 1)) for _ in indices]
    groups = [[i for i, o in zip(indices, owner, strict=True) if o == g] for g in range(count)]
    groups = [g for g in groups if g]
    if len(groups) < 2:
        return
    s = PlanSettings(allocator=allocator, on_shortage="merge")  # type: ignore[arg-type]
    try:
        plans = [plan(_hidden_except(topo, g), s) for g in groups]
    except PlanError:
        event("PlanError")
        return
    if any(said in w for p in plans for w in p.warnings for said in OVERLAP_SAID):
        event("overlap said")
        return
    event(f"{len(plans)} planned")
    seen: dict[int, str] = {}
    for i, p in enumerate(plans):
        named = [(f"rank {r.rank}", r.slot.cpus) for r in p.ranks]
        named += [("engine", p.engine.cpus)] if p.engine is not None else []
        for name, cpus in named:
            for cpu in cpus:
                assert cpu not in seen, (cpu, f"supervisor {i} {name}", seen[cpu], p.warnings)
                seen[cpu] = f"supervisor {i} {name}"
