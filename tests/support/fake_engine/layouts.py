"""Stand-ins for vLLM's and SGLang's process trees, titled with the real setproctitle.

Each spawns its processes the way the engine does (multiprocessing "spawn"),
titles them exactly as the engine's sources do, reads the engine's own flags
with their defaults, and records in `--record-dir` which local device each
process drives (`<pid>` holding the device ordinal): the test knows which
process is which rank without asking the supervisor.

vLLM (vllm/v1/engine/core.py run_engine_core, vllm/v1/executor/
multiproc_executor.py WorkerProc, vllm/utils/system_utils.py): the API server
starts one engine core per local DP rank; a core with TP x PP > 1 starts one
worker per rank, titled `Worker` before device init, then with its parallel
suffixes; a core with one GPU runs the model itself.
SGLang (python/sglang/srt/entrypoints/engine.py _launch_subprocesses,
managers/data_parallel_controller.py, managers/scheduler.py): one scheduler
per GPU, through a DP controller when dp > 1, and a detokenizer.
Run as `python -m <package>` from the test's module shims.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import setproctitle

# Set in a stand-in's environment: its vLLM workers hang in device init.
STALL_ENV = "FAKE_ENGINE_STALL_INIT"
# Set to "reverse": each vLLM worker opens /dev/nvidia<world - 1 - rank> after
# its title (the device then disagrees with the title, and wins).
OPEN_DEVICE_ENV = "FAKE_ENGINE_OPEN_DEVICE"


def _hold(record_dir: str | None, device: int | None, threads: int = 2) -> None:
    """Record the device this process drives, start threads, and sleep like a busy engine."""
    if record_dir is not None and device is not None:
        tmp = os.path.join(record_dir, f".{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(str(device))
        os.rename(tmp, os.path.join(record_dir, str(os.getpid())))
    for _ in range(threads):
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    time.sleep(3600)


def _title(prefix: str, name: str, suffix: str = "") -> None:
    # vllm/utils/system_utils.py set_process_title
    if suffix:
        name = f"{name}_{suffix}"
    setproctitle.setproctitle(f"{prefix}::{name}")


# -- vLLM ------------------------------------------------------------------------------------


def vllm_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("serve", nargs="?")
    p.add_argument("model", nargs="?")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None)
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0)
    p.add_argument("--data-parallel-rank", "-dpn", type=int, default=None)
    p.add_argument("--nnodes", "-n", type=int, default=1)
    p.add_argument("--node-rank", "-r", type=int, default=0)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--record-dir")
    return p.parse_known_args(list(argv))[0]


def vllm_local_dp(args: argparse.Namespace) -> tuple[int, int]:
    """(the node's first DP rank, how many run here): vllm/engine/arg_utils.py
    create_engine_config."""
    if args.data_parallel_rank is not None:
        return args.data_parallel_rank, 1
    if args.data_parallel_size_local is not None:
        return args.data_parallel_start_rank, args.data_parallel_size_local
    return 0, args.data_parallel_size


def vllm_nodes_within_dp(args: argparse.Namespace) -> int:
    """vllm/config/parallel.py ParallelConfig.nnodes_within_dp."""
    if args.nnodes == 1:
        return 1
    return args.nnodes // (args.data_parallel_size // vllm_local_dp(args)[1])


def vllm_worker(args: argparse.Namespace, dp_rank: int, local_dp: int, rank: int) -> None:
    prefix = os.environ.get("VLLM_PROCESS_NAME_PREFIX", "VLLM")
    _title(prefix, "Worker")  # before init_device: the parallel groups do not exist yet
    if os.environ.get(STALL_ENV) == "1":
        _hold(None, None)  # device init never returns: the title stays `Worker`
    time.sleep(0.3)
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    pp_rank, tp_rank = divmod(rank, tp)
    name = "Worker"
    if args.data_parallel_size > 1:
        name += f"_DP{dp_rank}"
    if pp > 1:
        name += f"_PP{pp_rank}"
    if tp > 1:
        name += f"_TP{tp_rank}"
    if args.enable_expert_parallel:
        name += f"_EP{dp_rank * tp + tp_rank}"
    _title(prefix, name)
    # vllm/v1/worker/gpu_worker.py init_device: the local rank, offset by the
    # local DP rank's devices unless one DP rank spans nodes.
    world = tp * pp
    within = vllm_nodes_within_dp(args)
    local = rank - (args.node_rank % within) * (world // within)
    device = local if within > 1 else local_dp * world + rank
    if os.environ.get(OPEN_DEVICE_ENV) == "reverse":
        device = tp * pp - 1 - rank
        held = os.open(f"/dev/nvidia{device}", os.O_RDWR)  # as CUDA's context holds its GPU
        assert held >= 0
    _hold(args.record_dir, device)


def vllm_engine_core(args: argparse.Namespace, dp_rank: int, local_dp: int) -> None:
    prefix = os.environ.get("VLLM_PROCESS_NAME_PREFIX", "VLLM")
    if args.data_parallel_size > 1 or dp_rank > 0:
        _title(prefix, "EngineCore", f"DP{dp_rank}")
    else:
        _title(prefix, "EngineCore")
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    if world == 1:
        _hold(args.record_dir, local_dp)  # UniProcExecutor: the model runs here
        return
    ctx = multiprocessing.get_context("spawn")
    # vllm/v1/executor/multiproc_executor.py: this node's share of the world.
    within = vllm_nodes_within_dp(args)
    first = (world // within) * (args.node_rank % within)
    procs = [
        ctx.Process(target=vllm_worker, args=(args, dp_rank, local_dp, r))
        for r in range(first, first + world // within)
    ]
    for proc in procs:
        proc.start()
    _hold(None, None)


def vllm_main(argv: Sequence[str]) -> None:
    """The API server: one engine core per local DP rank, then serve."""
    args = vllm_args(argv)
    start, local = vllm_local_dp(args)
    ctx = multiprocessing.get_context("spawn")
    cores = [ctx.Process(target=vllm_engine_core, args=(args, start + d, d)) for d in range(local)]
    for core in cores:
        core.start()
    _hold(None, None, threads=1)


# -- SGLang ------------------------------------------------------------------------------------


def sglang_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path")
    p.add_argument("--tp-size", "--tp", type=int, default=1)
    p.add_argument("--pp-size", "--pp", type=int, default=1)
    p.add_argument("--dp-size", "--dp", type=int, default=1)
    p.add_argument("--ep-size", "--ep", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--gpu-id-step", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--record-dir")
    return p.parse_known_args(list(argv))[0]


# The module SGLang's grammar pool is created in (a bare ThreadPoolExecutor()):
# python/sglang/srt/constrained/base_grammar_backend.py. The stand-in creates
# it with that module name so the start-up hook treats it as SGLang's.
GRAMMAR_MODULE = "sglang.srt.constrained.base_grammar_backend"


def sglang_grammar_pool() -> concurrent.futures.ThreadPoolExecutor:
    code = compile(
        "import concurrent.futures\npool = concurrent.futures.ThreadPoolExecutor()\n",
        "<grammar>",
        "exec",
    )
    scope: dict[str, object] = {"__name__": GRAMMAR_MODULE}
    exec(code, scope)
    pool = scope["pool"]
    assert isinstance(pool, concurrent.futures.ThreadPoolExecutor)
    return pool


def sglang_scheduler(
    args: argparse.Namespace, gpu_id: int, tp_rank: int, pp_rank: int, dp_rank: int | None
) -> None:
    prefix = ""
    if dp_rank is not None:
        prefix += f" DP{dp_rank}"
    if args.pp_size > 1:
        prefix += f" PP{pp_rank}"
    if args.tp_size > 1:
        prefix += f" TP{tp_rank}"
    if args.ep_size > 1:
        prefix += f" EP{tp_rank // (args.tp_size // args.ep_size)}"
    setproctitle.setproctitle(f"sglang::scheduler{prefix.replace(' ', '_')}")
    time.sleep(0.5)  # the model loads; then the grammar backend and its pool
    pool = sglang_grammar_pool()
    # Its threads start on demand, one per submit up to max_workers: keep them all busy.
    for _ in range(pool._max_workers + 2):
        pool.submit(time.sleep, 3600)
    record = args.record_dir
    if record is not None:
        with open(os.path.join(record, f"pool-{os.getpid()}"), "w") as f:
            f.write(str(pool._max_workers))
    _hold(record, gpu_id)


def _launch_tp_group(args: argparse.Namespace, base_gpu_id: int, dp_rank: int | None) -> list:  # type: ignore[type-arg]
    ctx = multiprocessing.get_context("spawn")
    procs = []
    # engine.py _launch_subprocesses: this node's PP stages and TP ranks.
    nodes_per_stage = max(args.nnodes // args.pp_size, 1)
    tp_node = args.tp_size // nodes_per_stage
    pp_node = max(args.pp_size // args.nnodes, 1)
    pp_first = pp_node * (args.node_rank // nodes_per_stage)
    tp_first = tp_node * (args.node_rank % nodes_per_stage)
    for pp_rank in range(pp_first, pp_first + pp_node):
        for tp_rank in range(tp_first, tp_first + tp_node):
            gpu_id = (
                args.base_gpu_id
                + base_gpu_id
                + (pp_rank % pp_node) * tp_node
                + (tp_rank % tp_node) * args.gpu_id_step
            )
            proc = ctx.Process(
                target=sglang_scheduler, args=(args, gpu_id, tp_rank, pp_rank, dp_rank)
            )
            proc.start()
            procs.append(proc)
    return procs


def sglang_dp_controller(args: argparse.Namespace) -> None:
    setproctitle.setproctitle("sglang::data_parallel_controller")
    base = 0
    for dp_rank in range(args.dp_size):
        _launch_tp_group(args, base, dp_rank)
        base += args.tp_size * args.pp_size * args.gpu_id_step  # launch_dp_schedulers
    _hold(None, None, threads=0)


def sglang_detokenizer() -> None:
    setproctitle.setproctitle("sglang::detokenizer")
    _hold(None, None, threads=0)


def sglang_main(argv: Sequence[str]) -> None:
    """The launcher (HTTP server + TokenizerManager): schedulers, then the detokenizer."""
    args = sglang_args(argv)
    ctx = multiprocessing.get_context("spawn")
    if args.dp_size == 1:
        _launch_tp_group(args, 0, None)
    else:
        ctx.Process(target=sglang_dp_controller, args=(args,)).start()
    ctx.Process(target=sglang_detokenizer).start()
    _hold(None, None, threads=1)


# -- Ray (shaped as `ray start --head --block`) ----------------------------------------------


RAY_WORKER = """
import os, sys, time
import setproctitle
sys.path.insert(0, sys.argv[3])
from tests.support.fake_engine.layouts import _hold
setproctitle.setproctitle("ray::IDLE")  # a pooled worker (python/ray/_private/workers)
time.sleep(0.3)
setproctitle.setproctitle("ray::RayWorkerWrapper")  # an actor was placed in it
device = int(sys.argv[1])
held = os.open(f"/dev/nvidia{device}", os.O_RDWR)  # the actor initialised its GPU
_hold(sys.argv[2], device)
"""


def ray_raylet(record_dir: str, workers: int) -> None:
    """The raylet: starts the worker processes actors run in (fork/exec, as Ray does)."""
    setproctitle.setproctitle("/opt/ray/core/src/ray/raylet/raylet --node_ip_address=127.0.0.1")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    for i in range(workers):
        # The first actor gets the last GPU: creation order is not device order.
        device = workers - 1 - i
        subprocess.Popen([sys.executable, "-c", RAY_WORKER, str(device), record_dir, repo])
    _hold(None, None, threads=0)


def ray_main(argv: Sequence[str]) -> None:
    """`ray start --head --block`: the head process and its raylet."""
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--record-dir")
    args = p.parse_known_args(list(argv))[0]
    ctx = multiprocessing.get_context("spawn")
    ctx.Process(target=ray_raylet, args=(args.record_dir, args.workers)).start()
    _hold(None, None, threads=0)
