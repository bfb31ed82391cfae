"""Which engine a command runs, and its parallel layout read from the engine's own flags (pure).

`[engine] kind` (DESIGN 3.6): "vllm", "sglang", "torchrun", "ray", "custom",
or "auto" (recognised from the command by `recognise_kind`). `vllm_layout`
and `sglang_layout` read the sizes each engine derives its process titles
and device indexes from, with the engines' own defaults; the rules that use
them are in `supervisor.engines.kind_rules`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

EngineKind = Literal["auto", "vllm", "sglang", "torchrun", "ray", "custom"]
ENGINE_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)
ResolvedKind = Literal["vllm", "sglang", "torchrun", "ray", "custom"]


def recognise_kind(argv: Sequence[str]) -> ResolvedKind:
    """The engine an `[engine] command` runs (pure): `vllm serve`, `python -m
    vllm.entrypoints.*`, `python -m sglang.launch_server`, `torchrun` or
    `python -m torch.distributed.run`, `ray start`; "custom" for anything else."""
    if not argv:
        return "custom"
    script = _python_script(argv)
    if script is not None:
        # `vllm serve` as a running process shows its console script behind the
        # interpreter (`/usr/bin/python3 /usr/local/bin/vllm serve ...`): what a
        # node agent or an attach by command line reads from /proc/<pid>/cmdline.
        argv = argv[script:]
    first = os.path.basename(argv[0])
    if first == "vllm" and "serve" in argv[1:2]:
        return "vllm"
    if first == "torchrun":
        return "torchrun"
    if first == "ray" and "start" in argv[1:2]:
        return "ray"
    module = _python_module(argv)
    if module is not None:
        if module == "vllm.entrypoints" or module.startswith("vllm.entrypoints."):
            return "vllm"
        if module in ("sglang.launch_server", "sglang.srt.entrypoints.http_server"):
            return "sglang"
        if module in ("torch.distributed.run", "torch.distributed.launch"):
            return "torchrun"
    return "custom"


CONSOLE_SCRIPTS = ("vllm", "torchrun", "ray")  # the entry points whose shebang is python


def _python_script(argv: Sequence[str]) -> int | None:
    """The index of a known console script run by its interpreter
    (`python3 [opts] /path/vllm ...`), or None."""
    if not os.path.basename(argv[0]).startswith("python"):
        return None
    for i, word in enumerate(argv[1:], start=1):
        if word.startswith("-"):
            if word in ("-m", "-c"):
                return None
            continue
        return i if os.path.basename(word) in CONSOLE_SCRIPTS else None
    return None


def _python_module(argv: Sequence[str]) -> str | None:
    """M of `python[3[.N]] [opts] -m M ...`, or None."""
    first = os.path.basename(argv[0])
    if not first.startswith("python"):
        return None
    for i, word in enumerate(argv[1:-1], start=1):
        if word == "-m":
            return argv[i + 1]
        if not word.startswith("-"):
            return None  # a script: not run as a module
    return None


# -- reading flags as argparse does -------------------------------------------------------------


def _flag(argv: Sequence[str], names: Sequence[str]) -> tuple[str, str] | None:
    """(the name as written, its value) given last to any of `names` ("--tp 2" or
    "--tp=2"): argparse keeps the last."""
    found: tuple[str, str] | None = None
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                found = (name, argv[i + 1])
            elif word.startswith(name + "="):
                found = (name, word[len(name) + 1 :])
    return found


def flag_value(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The value given last to any of `names`, or None."""
    found = _flag(argv, names)
    return None if found is None else found[1]


def flag_int(argv: Sequence[str], names: Sequence[str], default: int) -> int:
    """An integer flag; ValueError names the flag as written when its value is not one."""
    found = _flag(argv, names)
    if found is None:
        return default
    name, text = found
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} {text!r}: not an integer") from None
    if value < 0:
        raise ValueError(f"{name} {value}: must not be negative")
    return value


def has_flag(argv: Sequence[str], names: Sequence[str]) -> bool:
    return any(word in names or any(word.startswith(n + "=") for n in names) for word in argv)


# -- vLLM -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VllmLayout:
    """The sizes vLLM's titles and device order follow, from `vllm serve` flags.

    Flag names and defaults from vllm/engine/arg_utils.py (EngineArgs,
    add_cli_args: `--data-parallel-rank/-dpn`, `--data-parallel-start-rank/-dpr`,
    `--data-parallel-size-local/-dpl`, `--nnodes/-n`, `--node-rank/-r`).
    """

    tp: int = 1  # --tensor-parallel-size, -tp
    pp: int = 1  # --pipeline-parallel-size, -pp
    pcp: int = 1  # --prefill-context-parallel-size, -pcp
    dp: int = 1  # --data-parallel-size, -dp
    dp_local: int = 1  # DP ranks whose engine cores run on this node
    dp_start: int = 0  # the first of them (the engine's data_parallel_rank)
    nnodes: int = 1  # --nnodes: all the nodes of the deployment (mp backend)
    node_rank: int = 0  # --node-rank
    backend: str | None = None  # --distributed-executor-backend

    @property
    def world(self) -> int:
        """Worker processes of one engine core (all nodes): PP x PCP x TP."""
        return self.pp * self.pcp * self.tp

    @property
    def core_drives_device(self) -> bool:
        """With one GPU per engine core and no `mp` executor forced, vLLM runs the
        model in the engine core itself (UniProcExecutor, vllm/v1/executor/abstract.py)."""
        return self.world == 1 and self.backend in (None, "uni")

    @property
    def nnodes_within_dp(self) -> int:
        """Nodes one DP rank's workers span (vllm/config/parallel.py
        ParallelConfig.nnodes_within_dp: nnodes // (dp // dp_local))."""
        if self.nnodes == 1:
            return 1
        return max(1, self.nnodes // max(1, self.dp // self.dp_local))

    @property
    def local_world(self) -> int:
        """Workers of one engine core on this node (ParallelConfig.local_world_size)."""
        return self.world // self.nnodes_within_dp

    def local_device(self, dp_rank: int, pp_rank: int, pcp_rank: int, tp_rank: int) -> int | None:
        """The ordinal among the engine's visible devices of worker (d, p, c, t).

        A worker's rank in its engine core's world is (p x PCP + c) x TP + t
        (vllm/distributed/parallel_state.py initialize_model_parallel reshapes
        the world to (-1, dp, pp, pcp, tp)). When one DP rank's workers span
        nodes, this node runs ranks from local_world x node_rank_within_dp
        (vllm/v1/executor/multiproc_executor.py _init_executor:
        global_start_rank) and each drives cuda:<local rank>. Otherwise the
        engine cores of DP ranks dp_start.. run here with local DP ranks 0..
        (vllm/v1/engine/utils.py launch_core_engines: CoreEngineProcManager
        start_index=dp_rank, local_start_index=0), local DP rank l owning
        devices l x world.. (utils.py get_device_indices; on CUDA
        vllm/v1/worker/gpu_worker.py init_device adds l x PP x TP to the
        worker's local rank, the same offset while PCP = 1).
        None: a rank that runs on another node.
        """
        rank = (pp_rank * self.pcp + pcp_rank) * self.tp + tp_rank
        within = self.nnodes_within_dp
        if within > 1:
            local = rank - (self.node_rank % within) * self.local_world
            return local if 0 <= local < self.local_world else None
        d = dp_rank - self.dp_start if self.dp > 1 else 0
        if not 0 <= d < self.dp_local:
            return None
        return d * self.world + rank


def vllm_layout(argv: Sequence[str]) -> VllmLayout:
    """vLLM's sizes from its flags (ValueError naming a flag that is not an integer).

    Which DP ranks run here, as vllm/engine/arg_utils.py create_engine_config
    decides: `--data-parallel-rank N` (external load balancing) is one local
    DP rank, N; else `--data-parallel-size-local L` runs L from
    `--data-parallel-start-rank` (default 0); else all of them, from 0 (a
    start rank without a local size is ignored there).
    """
    dp = max(1, flag_int(argv, ("--data-parallel-size", "-dp"), 1))
    external = flag_value(argv, ("--data-parallel-rank", "-dpn"))
    if external is not None:
        dp_local, dp_start = 1, flag_int(argv, ("--data-parallel-rank", "-dpn"), 0)
    elif flag_value(argv, ("--data-parallel-size-local", "-dpl")) is not None:
        dp_local = max(1, flag_int(argv, ("--data-parallel-size-local", "-dpl"), dp))
        dp_start = flag_int(argv, ("--data-parallel-start-rank", "-dpr"), 0)
    else:
        dp_local, dp_start = dp, 0
    return VllmLayout(
        tp=max(1, flag_int(argv, ("--tensor-parallel-size", "-tp"), 1)),
        pp=max(1, flag_int(argv, ("--pipeline-parallel-size", "-pp"), 1)),
        pcp=max(1, flag_int(argv, ("--prefill-context-parallel-size", "-pcp"), 1)),
        dp=dp,
        dp_local=dp_local,
        dp_start=dp_start,
        nnodes=max(1, flag_int(argv, ("--nnodes", "-n"), 1)),
        node_rank=flag_int(argv, ("--node-rank", "-r"), 0),
        backend=flag_value(argv, ("--distributed-executor-backend",)),
    )


# -- SGLang ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SglangLayout:
    """The sizes SGLang's titles and GPU ids follow, from `sglang.launch_server` flags
    (python/sglang/srt/server_args.py ServerArgs: names, aliases and defaults)."""

    tp: int = 1  # --tp-size, --tp, --tensor-parallel-size
    pp: int = 1  # --pp-size, --pp, --pipeline-parallel-size
    dp: int = 1  # --dp-size, --dp, --data-parallel-size
    base_gpu_id: int = 0  # --base-gpu-id
    gpu_id_step: int = 1  # --gpu-id-step
    nnodes: int = 1  # --nnodes
    node_rank: int = 0  # --node-rank
    dp_attention: bool = False  # --enable-dp-attention: DP ranks share the TP group's GPUs

    def local_device(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int | None:
        """The GPU id SGLang gives scheduler (d, p, t) on this node (None: it runs
        on another node).

        python/sglang/srt/entrypoints/engine.py _launch_subprocesses and
        managers/data_parallel_controller.py launch_tensor_parallel_group:
        nnodes_per_pp_rank = max(nnodes // pp, 1) nodes share one PP stage,
        each running tp // nnodes_per_pp_rank TP ranks from
        tp_per_node x (node_rank % nnodes_per_pp_rank), and pp_per_node =
        max(pp // nnodes, 1) stages from pp_per_node x (node_rank //
        nnodes_per_pp_rank); gpu_id = base_gpu_id + dp_base + (p %
        pp_per_node) x tp_per_node + (t % tp_per_node) x gpu_id_step.
        Without DP attention each DP rank's dp_base is the last one's plus
        tp x pp x gpu_id_step (launch_dp_schedulers); with it, all DP ranks
        split one TP group's GPUs (dp_base 0, launch_dp_attention_schedulers).
        """
        nodes_per_stage = max(self.nnodes // self.pp, 1)
        tp_per_node = max(self.tp // nodes_per_stage, 1)
        pp_per_node = max(self.pp // self.nnodes, 1)
        tp_first = tp_per_node * (self.node_rank % nodes_per_stage)
        pp_first = pp_per_node * (self.node_rank // nodes_per_stage)
        if not (
            tp_first <= tp_rank < tp_first + tp_per_node
            and pp_first <= pp_rank < pp_first + pp_per_node
        ):
            return None
        d = 0 if self.dp_attention or self.dp == 1 else dp_rank
        return (
            self.base_gpu_id
            + d * self.tp * self.pp * self.gpu_id_step
            + (pp_rank % pp_per_node) * tp_per_node
            + (tp_rank % tp_per_node) * self.gpu_id_step
        )


def sglang_layout(argv: Sequence[str]) -> SglangLayout:
    """SGLang's sizes from its flags (ValueError naming a flag that is not an integer)."""
    return SglangLayout(
        tp=max(1, flag_int(argv, ("--tp-size", "--tp", "--tensor-parallel-size"), 1)),
        pp=max(1, flag_int(argv, ("--pp-size", "--pp", "--pipeline-parallel-size"), 1)),
        dp=max(1, flag_int(argv, ("--dp-size", "--dp", "--data-parallel-size"), 1)),
        base_gpu_id=flag_int(argv, ("--base-gpu-id",), 0),
        gpu_id_step=max(1, flag_int(argv, ("--gpu-id-step",), 1)),
        nnodes=max(1, flag_int(argv, ("--nnodes",), 1)),
        node_rank=flag_int(argv, ("--node-rank",), 0),
        dp_attention=has_flag(argv, ("--enable-dp-attention",)),
    )
