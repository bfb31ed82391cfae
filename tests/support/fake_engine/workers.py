"""Worker entry points shaped as vLLM's and SGLang's, for the early-bind tests.

vLLM starts each worker as `context.Process(target=WorkerProc.worker_main,
kwargs={..., "local_rank": r, ...})` (vllm/v1/executor/multiproc_executor.py);
SGLang as `mp.Process(target=run_scheduler_process, args=(server_args,
port_args, gpu_id, tp_rank, ...))` (python/sglang/srt/entrypoints/engine.py).
The targets here have the same qualified names and parameters and report
where their first instruction runs: CPU affinity and the memory policy the
kernel shows for their heap (/proc/self/numa_maps).
"""

from __future__ import annotations

import json
import os
from typing import Any


def where_am_i() -> dict[str, Any]:
    """This thread's CPUs and the process's memory policy, as the kernel shows them."""
    with open("/proc/self/numa_maps") as f:
        policy = f.readline().split()[1]
    return {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)), "policy": policy}


def report(out: str) -> None:
    with open(out, "w") as f:
        json.dump(where_am_i(), f)


class WorkerProc:
    @staticmethod
    def worker_main(*, out: str, local_rank: int, rank: int = 0, **_: Any) -> None:
        report(out)


def run_scheduler_process(
    server_args: Any, port_args: Any, gpu_id: int, tp_rank: int, *rest: Any, out: str = ""
) -> None:
    report(out)


def unrelated_target(out: str, local_rank: int = 0) -> None:
    report(out)
