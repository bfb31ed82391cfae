"""Ranks numbered as engines number them, and where the engine sits (docs/contracts.md §3).

Rank r drives the r-th device of the visibility list (CUDA's ordinal, what
LOCAL_RANK means), and gets that device's CPUs; on hosts with device-free
nodes the engine takes the one nearest rank 0's node. Checked on the fixture
hosts `container_uuid` and `xeon6_snc3_b200` through discovery, the planner
and the per-rank spawn specs, and on in-memory hosts for the tie rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from supervisor.cli import make_plan
from supervisor.config import load_config
from supervisor.cpulist import parse_cpulist
from supervisor.examples.hosts import (
    SNC3_GPU_NODES,
    UUID_CONTAINER_CPUS,
    UUID_CONTAINER_ORDER,
    UUID_CONTAINER_UUIDS,
    UUID_CONTAINER_VISIBLE,
    container_uuid,
    xeon6_snc3_b200,
)
from supervisor.plan.placement import Placement, PlanSettings
from supervisor.plan.planner import plan
from supervisor.run.spec import build_specs
from supervisor.topology.model import Topology
from tests.support.plan_invariants import check_placement
from tests.support.plan_topology import build_topology, dev

NO_ENGINE = "[placement.engine]\nenabled = false\n"


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return container_uuid(tmp_path_factory.mktemp("hosts"))


@pytest.fixture(scope="module")
def snc3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return xeon6_snc3_b200(tmp_path_factory.mktemp("hosts"))


def planned(
    root: Path, env: Mapping[str, str] | None = None, config: str | None = None
) -> tuple[Topology, Placement]:
    topology, placement = make_plan(str(root), config, env or {})
    check_placement(topology, placement)
    return topology, placement


def write_config(tmp_path: Path, text: str = "") -> str:
    path = tmp_path / "supervisor.toml"
    path.write_text('[workers]\ncommand = ["w", "{rank}", "{local_rank}"]\n' + text)
    return str(path)


def node_cpus(topology: Topology, node: int) -> set[int]:
    return set(topology.node(node).cpus)


# -- a container told its GPUs by UUID, out of index order ------------------------


def test_uuid_list_numbers_ranks_in_its_order(container: Path) -> None:
    topo, p = planned(container, {"CUDA_VISIBLE_DEVICES": UUID_CONTAINER_VISIBLE})
    # LOCAL_RANK r = cuda:r = the r-th UUID of the list: GPU 6, 1, 5, 2.
    assert [r.device.index for r in p.ranks] == list(UUID_CONTAINER_ORDER)
    assert [r.local_rank for r in p.ranks] == [0, 1, 2, 3]
    assert [r.device.uuid for r in p.ranks] == UUID_CONTAINER_VISIBLE.split(",")
    allowed = parse_cpulist(UUID_CONTAINER_CPUS)
    for r in p.ranks:
        node = r.device.numa_node
        assert node == (1 if r.device.index >= 4 else 0)
        assert set(r.slot.cpus) <= node_cpus(topo, node) & allowed
        assert r.slot.mems == (node,)
    # Rank 0 drives GPU 6 on node 1: its CPUs and the engine are there, not
    # on node 0 where GPU 1 (index order's first visible GPU) sits.
    assert p.engine is not None and set(p.engine.cpus) <= node_cpus(topo, 1)
    assert p.engine.mems == (1,) and p.engine_node is None


def test_uuid_list_shares_belong_to_the_device_not_the_rank(
    container: Path, tmp_path: Path
) -> None:
    # Without an engine (which follows rank 0's node), a GPU's CPUs are the
    # same whatever rank the list gives it: shares go by the host's order.
    cfg = write_config(tmp_path, NO_ENGINE)
    _, by_uuid = planned(container, {"CUDA_VISIBLE_DEVICES": UUID_CONTAINER_VISIBLE}, cfg)
    by_index = ",".join(str(i) for i in sorted(UUID_CONTAINER_ORDER))
    _, in_order = planned(container, {"CUDA_VISIBLE_DEVICES": by_index}, cfg)
    assert [r.device.index for r in in_order.ranks] == sorted(UUID_CONTAINER_ORDER)
    cpus_a = {r.device.index: r.slot for r in by_uuid.ranks}
    cpus_b = {r.device.index: r.slot for r in in_order.ranks}
    assert cpus_a == cpus_b


def test_two_containers_listing_disjoint_gpus_never_overlap(
    container: Path, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path, NO_ENGINE)
    others = ",".join(UUID_CONTAINER_UUIDS[i] for i in (7, 0, 4, 3))
    _, a = planned(container, {"CUDA_VISIBLE_DEVICES": UUID_CONTAINER_VISIBLE}, cfg)
    _, b = planned(container, {"CUDA_VISIBLE_DEVICES": others}, cfg)
    assert [r.device.index for r in b.ranks] == [7, 0, 4, 3]
    a_cpus = {c for r in a.ranks for c in r.slot.cpus}
    b_cpus = {c for r in b.ranks for c in r.slot.cpus}
    assert a_cpus and b_cpus and not a_cpus & b_cpus


def test_spawned_rank_gets_its_listed_gpu(container: Path, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    env = {"CUDA_VISIBLE_DEVICES": UUID_CONTAINER_VISIBLE}
    _, p = planned(container, env, cfg)
    specs = [s for s in build_specs(load_config(cfg), p, env, "python3") if s.key != "engine"]
    # Named by UUID, as the operator's list names them: the same GPU whatever
    # CUDA_DEVICE_ORDER says; {rank} and {local_rank} are the list position.
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == UUID_CONTAINER_VISIBLE.split(",")
    assert [s.argv for s in specs] == [("w", str(r), str(r)) for r in range(4)]
    assert [s.slot for s in specs] == [r.slot for r in p.ranks]
    # The same GPUs listed by index: each rank's index, in the list's order.
    env = {"CUDA_VISIBLE_DEVICES": "6,1,5,2"}
    _, q = planned(container, env, cfg)
    specs = [s for s in build_specs(load_config(cfg), q, env, "python3") if s.key != "engine"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["6", "1", "5", "2"]
    assert q.ranks == p.ranks


# -- Xeon 6 SNC3: GPUs on nodes 0, 2, 3, 5; none on 1 and 4 ------------------------


def test_snc3_engine_takes_the_device_free_node_nearest_rank_0(snc3: Path) -> None:
    topo, p = planned(snc3)
    assert [r.device.numa_node for r in p.ranks] == [n for n in SNC3_GPU_NODES for _ in (0, 1)]
    for r in p.ranks:
        assert r.device.numa_node is not None
        assert set(r.slot.cpus) <= node_cpus(topo, r.device.numa_node)
    # Node 1 is 12 from rank 0's node 0, node 4 is 21: the engine sits on 1,
    # and GPUs 0 and 1 split every CPU of node 0 between them.
    assert p.engine is not None and p.engine_node == 1
    assert set(p.engine.cpus) <= node_cpus(topo, 1) and p.engine.mems == (1,)
    assert set(p.rank(0).slot.cpus) | set(p.rank(1).slot.cpus) == node_cpus(topo, 0)
    assert dict(p.engine.roles).keys() == {"main", "so_compiler"}
    assert any(w.startswith("engine: on node 1") and "node 0" in w for w in p.warnings)
    assert p.to_doc()["engine_node"] == 1


@pytest.mark.parametrize(
    ("visible", "rank0_node", "engine_node"),
    [("4,5,6,7", 3, 4), ("6,0", 5, 4), ("2,7", 2, 1), ("GPU-b2005e6d,GPU-b2001e6d", 3, 4)],
)
def test_snc3_engine_follows_rank_0_of_the_list(
    snc3: Path, visible: str, rank0_node: int, engine_node: int
) -> None:
    topo, p = planned(snc3, {"CUDA_VISIBLE_DEVICES": visible})
    assert p.ranks[0].device.numa_node == rank0_node
    assert p.engine is not None and p.engine_node == engine_node
    assert set(p.engine.cpus) <= node_cpus(topo, engine_node)


def test_snc3_without_the_free_nodes_in_the_cpuset_keeps_the_old_rule(tmp_path: Path) -> None:
    # Nodes 1 (48-71 ...) and 4 outside the cpuset: every usable node has a
    # GPU, so the engine comes out of rank 0's node as on any 2-socket host.
    cpuset = "0-23,48-95,120-167,192-239,264-287"
    topo, p = planned(xeon6_snc3_b200(tmp_path, cpuset))
    assert p.engine is not None and p.engine_node is None
    assert set(p.engine.cpus) <= node_cpus(topo, 0) and p.engine.mems == (0,)
    assert "engine_node" not in p.to_doc()
    assert not any(w.startswith("engine: on node") for w in p.warnings)


# -- the rules on small in-memory hosts ----------------------------------------------


def test_ties_between_free_nodes_go_to_the_lowest_id() -> None:
    dist = [[10, 30, 20, 30], [30, 10, 20, 30], [20, 20, 10, 30], [30, 30, 30, 10]]
    topo = build_topology([8, 8, 8, 8], devices=[dev(0, 2), dev(1, 3)], distances=dist)
    p = plan(topo, PlanSettings())
    check_placement(topo, p)
    assert p.engine_node == 0  # nodes 0 and 1 are both 20 from node 2
    # A visibility list that puts GPU 1 (node 3) first moves the engine with it.
    listed = build_topology(
        [8, 8, 8, 8], devices=[dev(0, 2, ordinal=1), dev(1, 3, ordinal=0)], distances=dist
    )
    q = plan(listed, PlanSettings())
    check_placement(listed, q)
    assert q.ranks[0].device.index == 1 and q.engine_node == 0  # 0 and 1 both 30 away
    assert q.rank(1).slot.cpus == p.rank(0).slot.cpus  # GPU 0 keeps its CPUs


def test_a_free_node_too_small_for_the_engine_is_passed_over() -> None:
    # Node 1 keeps 2 of its cores in the cpuset: the engine needs 3 (main 2 +
    # so_compiler 4 CPUs at 2 threads per core is 3 cores), so node 2 it is.
    allowed = set(range(8)) | {8, 9} | set(range(16, 24))
    allowed |= {c + 24 for c in allowed}
    topo = build_topology([8, 8, 8], threads_per_core=2, devices=[dev(0, 0)], allowed_cpus=allowed)
    p = plan(topo, PlanSettings())
    check_placement(topo, p)
    assert p.engine_node == 2
    # With node 2 gone as well, the engine comes out of rank 0's node again.
    small = build_topology(
        [8, 8, 8],
        threads_per_core=2,
        devices=[dev(0, 0)],
        allowed_cpus=allowed - set(range(16, 24)) - set(range(40, 48)),
    )
    q = plan(small, PlanSettings())
    check_placement(small, q)
    assert q.engine_node is None and q.engine is not None
    assert {small.cpu(c).node for c in q.engine.cpus} == {0}


def test_global_slice_devices_keep_the_free_nodes() -> None:
    # A device of unknown locality is sliced from the nodes no known device
    # uses: the engine stays on rank 0's node rather than take from them.
    topo = build_topology([8, 8, 8], devices=[dev(0, 0), dev(1, None)])
    p = plan(topo, PlanSettings())
    check_placement(topo, p)
    assert p.strategy == "mixed" and p.engine_node is None
    assert p.engine is not None and {topo.cpu(c).node for c in p.engine.cpus} == {0}


def test_hidden_devices_make_their_node_no_free_node() -> None:
    # GPU 1 on node 1 is hidden here but another supervisor may drive it.
    topo = build_topology([8, 8, 8], devices=[dev(0, 0), dev(1, 1, visible=False)])
    p = plan(topo, PlanSettings(reserve_hidden=False))
    check_placement(topo, p)
    assert p.engine_node == 2


def test_engine_node_round_trips_through_the_document() -> None:
    topo = build_topology([8, 8], devices=[dev(0, 0)])
    p = plan(topo, PlanSettings())
    assert p.engine_node == 1
    assert Placement.from_doc(p.to_doc()) == p
