"""Discovery + plan on every fixture host tree (tests/hosts.py): docs/contracts.md §3
properties for all, and what each class of machine must get."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from supervisor.cli import make_plan
from supervisor.cpulist import parse_cpulist
from supervisor.errors import PlanError
from supervisor.examples.builder import FakeHost
from supervisor.examples.hosts import (
    ALL_HOSTS,
    CONTAINER_ALLOWED,
    GB200_HBM_NODES,
    TIGHT_CONTAINER_ALLOWED,
    tight_container,
)
from supervisor.plan.placement import Placement
from supervisor.topology.model import Topology
from tests.support.plan_invariants import check_placement

WORKERS = '[workers]\ncommand = ["true"]\n'


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hosts")
    return {name: build(base) for name, build in ALL_HOSTS.items()}


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "supervisor.toml"
    path.write_text(WORKERS + text)
    return str(path)


def planned(
    root: Path, config_path: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[Topology, Placement]:
    topology, placement = make_plan(str(root), config_path, env or {})
    check_placement(topology, placement)
    return topology, placement


def node_cpus(topology: Topology, node: int) -> set[int]:
    return set(topology.node(node).cpus)


@pytest.mark.parametrize("name", sorted(ALL_HOSTS))
def test_default_plan_keeps_every_invariant(hosts: dict[str, Path], name: str) -> None:
    _, placement = planned(hosts[name])
    assert placement.ranks


def test_dgx_h100_gpus_0_to_3_on_node_0(hosts: dict[str, Path]) -> None:
    topo, p = planned(hosts["dgx_h100"])
    assert len(p.ranks) == 8
    for r in p.ranks:
        node = 0 if r.rank < 4 else 1
        assert set(r.slot.cpus) <= node_cpus(topo, node)
        assert r.slot.mems == (node,)
    assert p.engine is not None and set(p.engine.cpus) <= node_cpus(topo, 0)


def test_epyc_nps4_gpu_0_and_1_get_node_3(hosts: dict[str, Path]) -> None:
    topo, p = planned(hosts["dgx_a100_nps4"])
    for rank in (0, 1):
        assert set(p.rank(rank).slot.cpus) <= node_cpus(topo, 3)
        assert p.rank(rank).slot.mems == (3,)
    # Nodes 0, 2, 4 and 6 hold no GPU: the engine takes the nearest of them to
    # rank 0's node 3 (0 and 2 are both 12 away; the lower id wins), so GPUs
    # 0 and 1 split all 16 cores of node 3.
    assert p.engine is not None and set(p.engine.cpus) <= node_cpus(topo, 0)
    assert p.engine_node == 0 and p.engine.mems == (0,)
    assert len(p.rank(0).slot.cpus) + len(p.rank(1).slot.cpus) == len(node_cpus(topo, 3))


def test_grace_blackwell_mems_never_hbm_nodes(hosts: dict[str, Path]) -> None:
    _, p = planned(hosts["gb200_tray"])
    assert [r.slot.mems for r in p.ranks] == [(0,), (0,), (1,), (1,)]
    assert p.engine is not None
    for slot in [*(r.slot for r in p.ranks), p.engine]:
        assert not set(slot.mems) & set(GB200_HBM_NODES)


def test_ascend_a3_global_slice_gives_each_npu_40_cpus(
    hosts: dict[str, Path], tmp_path: Path
) -> None:
    cfg = config(tmp_path, '[placement]\nstrategy = "global-slice"\n')
    _, p = planned(hosts["ascend_a3"], cfg)
    assert len(p.ranks) == 16 and p.strategy == "global-slice" and p.engine is None
    for r in p.ranks:
        assert r.slot.cpus == tuple(range(40 * r.rank, 40 * r.rank + 40))
    # With an engine it comes out of NPU 0's slice; the other slices stay.
    cfg = config(tmp_path, '[engine]\ncommand = "true"\n[placement]\nstrategy = "global-slice"\n')
    _, q = planned(hosts["ascend_a3"], cfg)
    assert q.engine is not None
    assert sorted(q.engine.cpus + q.rank(0).slot.cpus) == list(range(40))
    assert [r.slot.cpus for r in q.ranks[1:]] == [r.slot.cpus for r in p.ranks[1:]]


def test_ascend_a3_default_is_numa_affine_on_folded_nodes(hosts: dict[str, Path]) -> None:
    topo, p = planned(hosts["ascend_a3"])
    for r in p.ranks:
        assert r.device.numa_node is not None
        assert set(r.slot.cpus) <= node_cpus(topo, r.device.numa_node)


def test_five_and_three_pools_follow_their_socket(hosts: dict[str, Path]) -> None:
    topo, p = planned(hosts["five_three"])
    for r in p.ranks:
        assert set(r.slot.cpus) <= node_cpus(topo, 0 if r.rank < 5 else 1)
    sizes = [len(r.slot.cpus) for r in p.ranks]
    # node 0: 32 cores - 3 for the engine = 29 over 5 GPUs (6,6,6,6,5 cores);
    # node 1: 32 cores over 3 GPUs (11,11,10 cores); 2 threads per core.
    assert sizes == [12, 12, 12, 12, 10, 22, 22, 20]


def test_container_holes_stay_inside_the_cpuset(hosts: dict[str, Path]) -> None:
    topo, p = planned(hosts["container_holes"])
    allowed = parse_cpulist(CONTAINER_ALLOWED)
    for r in p.ranks:
        assert set(r.slot.cpus) <= allowed
        assert set(r.slot.cpus) <= node_cpus(topo, r.device.numa_node or 0)
    assert not p.warnings


def test_tight_container_errors_by_default(tmp_path: Path) -> None:
    # 4 allowed CPUs on node 1 for 2 GPUs: 2 each cannot hold irq + comm +
    # main, and on_shortage defaults to "error" on accelerator hosts.
    with pytest.raises(PlanError, match=r"rank 2 \(nvidia2 on node 1\) gets 2 CPUs"):
        make_plan(str(tight_container(tmp_path)), None, {})


def test_tight_container_merges_roles_when_allowed(tmp_path: Path) -> None:
    cfg = config(tmp_path, '[placement]\non_shortage = "merge"\n')
    _, p = planned(tight_container(tmp_path), cfg)
    allowed = parse_cpulist(TIGHT_CONTAINER_ALLOWED)
    for r in p.ranks:
        assert set(r.slot.cpus) <= allowed
    assert any("merged" in w for w in p.warnings)


def test_numa_unknown_mixes_and_names_the_device(hosts: dict[str, Path]) -> None:
    topo, p = planned(hosts["numa_unknown"])
    assert p.strategy == "mixed"
    by_bus = {r.device.bus_id: r for r in p.ranks}
    assert by_bus["0000:3b:00.0"].strategy == "numa-affine"  # from local_cpulist
    assert set(by_bus["0000:3b:00.0"].slot.cpus) <= node_cpus(topo, 1)
    assert by_bus["0000:5e:00.0"].strategy == "global-slice"
    assert any("0000:5e:00.0" in w for w in p.warnings)


def test_no_accelerator_host_plans_one_rank_per_node(hosts: dict[str, Path]) -> None:
    topo, p = planned(hosts["no_accel_2node"])
    assert [r.device.kind for r in p.ranks] == ["cpu", "cpu"]
    assert set(p.rank(1).slot.cpus) <= node_cpus(topo, 1)


def test_visibility_env_selects_ranks(hosts: dict[str, Path]) -> None:
    topo, p = planned(hosts["dgx_h100"], env={"CUDA_VISIBLE_DEVICES": "5,4"})
    # Ranks in the list's order: rank 0 drives GPU 5 (cuda:0 to the engine).
    assert [r.device.index for r in p.ranks] == [5, 4]
    # Hidden GPUs 6,7 keep their shares: GPU 4 and 5 get the first two of
    # four shares of node 1 (14 cores each); shares go by the host's order.
    # Another supervisor may drive GPUs 6,7 on this node, so the engine comes
    # out of rank 0's own share (GPU 5's), not the node's end (issue 27 item 3).
    assert set(p.rank(0).slot.cpus) | set(p.rank(1).slot.cpus) <= node_cpus(topo, 1)
    assert len(p.rank(0).slot.cpus) == 22 and len(p.rank(1).slot.cpus) == 28
    assert p.rank(1).slot.cpus[0] < p.rank(0).slot.cpus[0]
    assert p.engine is not None and set(p.engine.cpus) <= node_cpus(topo, 1)


def test_a3_without_locality_is_global_sliced_40_cpus_each(tmp_path: Path) -> None:
    # The A3 layout with no NPU-to-CPU signal (numa_node -1, no ubcore), as
    # vllm-ascend sees A3: auto falls back to global-slice, 640 / 16 = 40.
    h = FakeHost(tmp_path / "a3_unknown").cpus(4, 80, 2, "adjacent", nodes_per_socket=2)
    for i in range(16):
        h.ascend_npu(f"0000:{0x01 + i * 0x10:02x}:00.0", -1)
    topo, p = planned(h.build())
    assert p.strategy == "global-slice" and len(p.ranks) == 16
    assert len(p.warnings) == 1 and "ascend0" in p.warnings[0] and "ascend15" in p.warnings[0]
    for r in p.ranks[1:]:
        assert r.slot.cpus == tuple(range(40 * r.rank, 40 * r.rank + 40))
        assert r.slot.mems == (r.rank // 2,)  # 80 CPUs per node: two slices per node
    assert p.engine is not None
    assert sorted(p.engine.cpus + p.rank(0).slot.cpus) == list(range(40))
    assert len(topo.cpus) == 640
