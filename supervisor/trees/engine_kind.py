"""Which engine a command runs, and its parallel layout read from the engine's own flags (pure).

`[engine] kind` (DESIGN 3.6): "vllm", "sglang", "torchrun", "ray", "custom",
or "auto" (recognised from the command by `recognise_kind`). `vllm_layout`
and `sglang_layout` read the sizes each engine derives its process titles
and device indexes from, with the engines' own defaults; the rules that use
them are in `supervisor.trees.kind_rules`.
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

    Flag names and defaults from vllm/engine/arg_utils.py (EngineArgs) and
    vllm/entrypoints/openai/cli_args.py (`--data-parallel-start-rank`, `-dpr`).
    """

    tp: int = 1  # --tensor-parallel-size, -tp
    pp: int = 1  # --pipeline-parallel-size, -pp
    pcp: int = 1  # --prefill-context-parallel-size, -pcp
    dp: int = 1  # --data-parallel-size, -dp
    dp_local: int = 1  # --data-parallel-size-local, -dpl (default: all of dp here)
    dp_start: int = 0  # --data-parallel-start-rank, -dpr (secondary nodes, --headless)
    nnodes: int = 1  # --nnodes: one engine's TP x PP spread over nodes (mp backend)
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

    def local_device(self, dp_rank: int, pp_rank: int, pcp_rank: int, tp_rank: int) -> int | None:
        """The ordinal among the engine's visible devices of worker (d, p, c, t).

        Ranks of one engine core are laid out DP x PP x PCP x TP, TP fastest
        (vllm/distributed/parallel_state.py initialize_model_parallel reshapes
        the world to (-1, dp, pp, pcp, tp)); each local DP engine core gets the
        next `world` devices (vllm/v1/engine/utils.py, CUDA_VISIBLE_DEVICES per
        local DP rank). None: a rank that runs on another node.
        """
        d = dp_rank - self.dp_start if self.dp > 1 else 0
        if not 0 <= d < self.dp_local:
            return None
        in_core = (pp_rank * self.pcp + pcp_rank) * self.tp + tp_rank
        per_node = self.world // self.nnodes if self.nnodes > 1 else self.world
        if self.nnodes > 1:
            in_core -= self.node_rank * per_node
            if not 0 <= in_core < per_node:
                return None
        return d * per_node + in_core


def vllm_layout(argv: Sequence[str]) -> VllmLayout:
    """vLLM's sizes from its flags (ValueError naming a flag that is not an integer)."""
    dp = flag_int(argv, ("--data-parallel-size", "-dp"), 1)
    return VllmLayout(
        tp=max(1, flag_int(argv, ("--tensor-parallel-size", "-tp"), 1)),
        pp=max(1, flag_int(argv, ("--pipeline-parallel-size", "-pp"), 1)),
        pcp=max(1, flag_int(argv, ("--prefill-context-parallel-size", "-pcp"), 1)),
        dp=max(1, dp),
        dp_local=max(1, flag_int(argv, ("--data-parallel-size-local", "-dpl"), max(1, dp))),
        dp_start=flag_int(argv, ("--data-parallel-start-rank", "-dpr"), 0),
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
        """The GPU id SGLang gives scheduler (d, p, t) on this node.

        python/sglang/srt/entrypoints/engine.py _launch_subprocesses (and
        managers/data_parallel_controller.py for DP): gpu_id = base_gpu_id +
        (pp % pp_per_node) * tp_per_node + (tp % tp_per_node) * gpu_id_step,
        each DP group after the last (base += tp_per_node * gpu_id_step),
        except under DP attention, where DP splits the TP group itself.
        """
        nodes_per_tp_group = max(self.nnodes // self.pp, 1)
        tp_per_node = max(self.tp // nodes_per_tp_group, 1)
        pp_per_node = max(self.pp // self.nnodes, 1)
        d = 0 if self.dp_attention or self.dp == 1 else dp_rank
        return (
            self.base_gpu_id
            + d * tp_per_node * self.gpu_id_step
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
