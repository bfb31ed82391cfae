"""Which rank an engine-spawned worker is, before its own code runs (pure, no I/O).

The start-up hook (`supervisor/hook/pythonpath/sitecustomize.py`) runs in
every Python process of the engine's tree. Where a rule names the rank at
that moment, the hook puts the process on its rank's CPUs and memory policy
then, before CUDA/ACL initialise and before the worker allocates its host
buffers; the daemon's adoption confirms it later. This module writes the
rules the hook reads (`EARLY_ENV`): a plain `;`-separated text, so that a
process with no rank never parses JSON at start-up.

- `local=L:R,...`: local rank (an index among the visible devices, as
  LOCAL_RANK is) -> the supervisor's rank, as `rank_source.rank_tables` maps it;
- `env=NAME`: the integer in the variable NAME (`rank_from = ["env:NAME"]`,
  torchrun's LOCAL_RANK: torch/distributed/elastic/agent/server/
  local_elastic_agent.py `_start_workers` sets it in each worker's env);
- `call=QUALNAME:KWARG:INDEX`: a multiprocessing child whose target is
  QUALNAME; its local rank is keyword KWARG, else positional INDEX (-1: none).
  vLLM: vllm/v1/executor/multiproc_executor.py `WorkerProc.make_worker_process`
  starts `context.Process(target=WorkerProc.worker_main, kwargs=...)` with
  `local_rank` in the kwargs, the CUDA device index `Worker.init_device`
  uses. SGLang: python/sglang/srt/entrypoints/engine.py starts
  `mp.Process(target=run_scheduler_process, args=(server_args, port_args,
  gpu_id, tp_rank, ...))`, gpu_id being the device index (also passed as a
  keyword by engine_fragment.py).

A rule that could name the wrong rank is not written: vLLM with data
parallelism shifts `local_rank` by the DP rank inside the worker
(gpu_worker.py), after the hook has run, so the title decides there, at
adoption; cmdline and device sources need the worker to have run.
"""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.engines.kind_rules import KindRules
from supervisor.engines.rank_source import RankSource, rank_tables
from supervisor.plan.placement import Placement

EARLY_ENV = "PLACEMENT_SUPERVISOR_EARLY_RANK"
VLLM_WORKER_TARGET = "WorkerProc.worker_main:local_rank:-1"
SGLANG_WORKER_TARGET = "run_scheduler_process:gpu_id:2"


def early_rules(
    rules: KindRules | None, sources: Sequence[RankSource], placement: Placement
) -> str | None:
    """The hook's rules for an engine tree (`EARLY_ENV`), or None when no rule
    can name a rank before the worker runs. `sources` is `rank_from` (it
    overrides the kind's rules, as at adoption)."""
    items: list[str] = []
    if sources:
        items.extend(f"env={s.name}" for s in sources if s.kind == "env")
    elif rules is not None:
        if rules.kind == "torchrun":
            items.append("env=LOCAL_RANK")
        elif rules.kind == "vllm" and rules.vllm is not None:
            v = rules.vllm
            if v.dp == 1 and v.tp * v.pp * v.pcp > 1:
                items.append(f"call={VLLM_WORKER_TARGET}")
        elif rules.kind == "sglang":
            items.append(f"call={SGLANG_WORKER_TARGET}")
    if not items:
        return None
    local, _ = rank_tables(placement)
    pairs = ",".join(f"{lr}:{r}" for lr, r in sorted(local.items()))
    return ";".join([f"local={pairs}", *items])
