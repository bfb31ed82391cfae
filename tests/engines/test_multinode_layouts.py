"""The local device of each vLLM and SGLang rank on one node of a multi-node
deployment, from the engine's flags exactly as the engines take them (pure).

vLLM (vllm/engine/arg_utils.py create_engine_config, vllm/config/parallel.py
nnodes_within_dp / local_world_size, vllm/v1/engine/utils.py
launch_core_engines, vllm/v1/executor/multiproc_executor.py _init_executor,
vllm/v1/worker/gpu_worker.py init_device) and SGLang (python/sglang/srt/
entrypoints/engine.py _launch_subprocesses, managers/data_parallel_controller.py
launch_dp_schedulers / launch_tensor_parallel_group): each case says which
devices the node's processes drive; None is a rank that runs on another node.
"""

from __future__ import annotations

import pytest

from supervisor.engines.engine_kind import sglang_layout, vllm_layout
from supervisor.engines.kind_rules import name_sglang, name_vllm

V = ["vllm", "serve", "m"]
S = ["python", "-m", "sglang.launch_server", "--model-path", "m"]


@pytest.mark.parametrize(
    ("flags", "titles"),
    [
        pytest.param(
            # DP over two nodes, two DP ranks each (data_parallel_node_size 2,
            # nnodes_within_dp 1): node 1 runs the engine cores of DP 2 and 3
            # as local DP ranks 0 and 1.
            [
                "-tp",
                "2",
                "-dp",
                "4",
                "-dpl",
                "2",
                "-dpr",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--headless",
            ],
            {
                "VLLM::Worker_DP2_TP0": 0,
                "VLLM::Worker_DP2_TP1": 1,
                "VLLM::Worker_DP3_TP0": 2,
                "VLLM::Worker_DP3_TP1": 3,
                "VLLM::Worker_DP1_TP1": None,
            },
            id="dp-over-nodes-node1",
        ),
        pytest.param(
            ["-tp", "2", "-dp", "4", "-dpl", "2", "--nnodes", "2", "--node-rank", "0"],
            {"VLLM::Worker_DP1_TP1": 3, "VLLM::Worker_DP2_TP0": None},
            id="dp-over-nodes-node0",
        ),
        pytest.param(
            # One engine's TP spans two nodes: node 1 runs ranks 4-7 as cuda:0-3.
            ["-tp", "8", "--nnodes", "2", "--node-rank", "1", "--headless"],
            {"VLLM::Worker_TP4": 0, "VLLM::Worker_TP7": 3, "VLLM::Worker_TP3": None},
            id="tp-over-nodes",
        ),
        pytest.param(
            ["-tp", "2", "-pp", "2", "-n", "2", "-r", "1"],
            {"VLLM::Worker_PP1_TP0": 0, "VLLM::Worker_PP1_TP1": 1, "VLLM::Worker_PP0_TP1": None},
            id="pp-over-nodes",
        ),
        pytest.param(
            # Each DP rank spans two of four nodes (nnodes_within_dp 2): node 3 is
            # the second node of DP rank 1 and runs its TP ranks 2-3.
            ["-tp", "4", "-dp", "2", "-dpl", "1", "--nnodes", "4", "--node-rank", "3"],
            {"VLLM::Worker_DP1_TP2": 0, "VLLM::Worker_DP1_TP3": 1, "VLLM::Worker_DP1_TP1": None},
            id="dp-rank-spans-nodes",
        ),
        pytest.param(
            # External load balancing: one DP rank per `vllm serve`, its devices from 0.
            ["-tp", "2", "-dp", "4", "--data-parallel-rank", "3"],
            {"VLLM::Worker_DP3_TP0": 0, "VLLM::Worker_DP3_TP1": 1, "VLLM::Worker_DP2_TP1": None},
            id="external-lb",
        ),
        pytest.param(
            ["-dp", "4", "-dpn", "2"],
            {"VLLM::EngineCore_DP2": 0, "VLLM::EngineCore_DP1": None},
            id="external-lb-tp1",
        ),
        pytest.param(
            # A start rank without a local size is ignored by create_engine_config.
            ["-tp", "2", "-dp", "2", "-dpr", "2"],
            {"VLLM::Worker_DP0_TP1": 1, "VLLM::Worker_DP1_TP0": 2},
            id="start-rank-alone",
        ),
        pytest.param(
            ["-tp", "2", "-dp", "4", "-dpl=2", "-dpr=2", "--headless"],
            {"VLLM::Worker_DP3_TP1": 3, "VLLM::Worker_DP2_TP0": 0},
            id="secondary-node-equals",
        ),
    ],
)
def test_vllm_multi_node_devices(flags: list[str], titles: dict[str, int | None]) -> None:
    layout = vllm_layout(V + flags)
    got = {title: name_vllm(layout, "VLLM", title).local_rank for title in titles}
    assert got == titles
    assert all(name_vllm(layout, "VLLM", title).expected for title in titles)


def test_vllm_node_sizes_follow_parallel_config() -> None:
    v = vllm_layout([*V, "-tp", "4", "-dp", "2", "-dpl", "1", "--nnodes", "4", "-r", "3"])
    assert (v.nnodes_within_dp, v.local_world, v.dp_local, v.dp_start) == (2, 2, 1, 0)
    v = vllm_layout([*V, "-tp", "2", "-dp", "4", "-dpl", "2", "--nnodes", "2"])
    assert (v.nnodes_within_dp, v.local_world) == (1, 2)
    v = vllm_layout([*V, "-dp", "4", "--data-parallel-rank", "3", "-dpl", "1"])
    assert (v.dp_local, v.dp_start) == (1, 3)


@pytest.mark.parametrize(
    ("flags", "titles"),
    [
        pytest.param(
            # TP over two nodes: node 1 runs TP ranks 2-3 on GPUs 0-1.
            ["--tp", "4", "--nnodes", "2", "--node-rank", "1"],
            {"sglang::scheduler_TP2": 0, "sglang::scheduler_TP3": 1, "sglang::scheduler_TP1": None},
            id="tp-over-nodes",
        ),
        pytest.param(
            # One PP stage per node: node 1 runs stage 1 from GPU 0.
            ["--tp", "2", "--pp", "2", "--nnodes", "2", "--node-rank", "1"],
            {
                "sglang::scheduler_PP1_TP0": 0,
                "sglang::scheduler_PP1_TP1": 1,
                "sglang::scheduler_PP0_TP0": None,
            },
            id="pp-over-nodes",
        ),
        pytest.param(
            # Four nodes, two stages: each stage's TP group spans two nodes.
            ["--tp", "4", "--pp", "2", "--nnodes", "4", "--node-rank", "3"],
            {
                "sglang::scheduler_PP1_TP2": 0,
                "sglang::scheduler_PP1_TP3": 1,
                "sglang::scheduler_PP1_TP1": None,
                "sglang::scheduler_PP0_TP2": None,
            },
            id="pp-and-tp-over-nodes",
        ),
        pytest.param(
            # Each DP rank starts tp x pp x gpu_id_step GPUs after the last.
            ["--tp", "2", "--pp", "2", "--dp", "2"],
            {
                "sglang::scheduler_DP0_PP1_TP1": 3,
                "sglang::scheduler_DP1_PP0_TP0": 4,
                "sglang::scheduler_DP1_PP1_TP1": 7,
            },
            id="dp-pp-tp",
        ),
        pytest.param(
            ["--tp", "2", "--dp", "2", "--base-gpu-id", "1", "--gpu-id-step", "2"],
            {
                "sglang::scheduler_DP0_TP1": 3,
                "sglang::scheduler_DP1_TP0": 5,
                "sglang::scheduler_DP1_TP1": 7,
            },
            id="dp-base-step",
        ),
        pytest.param(
            # DP attention over two nodes: the DP ranks split the TP group.
            [
                "--tp",
                "8",
                "--dp",
                "4",
                "--enable-dp-attention",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
            ],
            {
                "sglang::scheduler_DP2_TP4": 0,
                "sglang::scheduler_DP3_TP7": 3,
                "sglang::scheduler_DP1_TP3": None,
            },
            id="dp-attention-over-nodes",
        ),
        pytest.param(
            ["--tp-size=4", "--nnodes=2", "--node-rank=1", "--base-gpu-id=4"],
            {"sglang::scheduler_TP2": 4, "sglang::scheduler_TP3": 5},
            id="equals-and-base",
        ),
    ],
)
def test_sglang_multi_node_devices(flags: list[str], titles: dict[str, int | None]) -> None:
    layout = sglang_layout(S + flags)
    got = {title: name_sglang(layout, title).local_rank for title in titles}
    assert got == titles
