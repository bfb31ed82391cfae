"""The value bench's engine stand-in: grammars compiled by real xgrammar on a pool made here (I/O).

    python -m tests.bench.value_engine OUT_DIR [WORKER_ARGV...]

vLLM's shape (vllm/v1/structured_output/__init__.py): StructuredOutputManager
makes `ThreadPoolExecutor(max_workers=(cpu_count + 1) // 2)`, unnamed, and
submits each request's grammar compile to it; its xgrammar backend builds a
`GrammarCompiler(..., max_threads=8)`, which starts that many std::threads per
compile. The bench's `executors` lists this module, as an operator's config
lists `vllm.v1.structured_output`. Writes OUT_DIR/engine.ready after the
first compile (the daemon's [ready] file), starts WORKER_ARGV (if given) as
its own child with LOCAL_RANK=0, then keeps compiling distinct schemas until
OUT_DIR/stop exists or it is killed. The worker is its child in its session,
as vLLM's engine core starts its workers (multiprocessing processes,
vllm/v1/executor/multiproc_executor.py; no setsid): with the kernel's
autogroups (sched(7)) the compile threads and the worker's main thread are
then scheduled in one group, thread by thread, as in a deployment.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.fake_engine.structured_output import VOCAB, schema

COMPILER_THREADS = 8  # vLLM's xgrammar backend
BATCH = 4  # requests arriving together
LIFETIME_S = 900.0  # never outlive a bench that died


def serve(out: Path, worker: list[str]) -> None:
    """Compile until told to stop; the pool is created here, in this module."""
    import xgrammar as xgr  # noqa: PLC0415 - imports torch, seconds: only here

    info = xgr.TokenizerInfo(encoded_vocab=VOCAB)
    # No cache: every request's schema is compiled, as with new schemas in traffic.
    compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS, cache_enabled=False)
    pool = ThreadPoolExecutor(max_workers=(multiprocessing.cpu_count() + 1) // 2)
    pool.submit(compiler.compile_json_schema, schema(0)).result()
    (out / "engine.ready").write_text(str(pool._max_workers))
    if worker:
        # Ended with this engine's process group (the bench, or the daemon's tree stop).
        subprocess.Popen(worker, env=dict(os.environ, LOCAL_RANK="0"), stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + LIFETIME_S
    i = 0
    while not (out / "stop").exists() and time.monotonic() < deadline:
        futures = [pool.submit(compiler.compile_json_schema, schema(i + k)) for k in range(BATCH)]
        for f in futures:
            f.result()
        i += BATCH


if __name__ == "__main__":
    # Run as a script this module is `__main__`; the hook goes by the name of
    # the module that creates the pool (vLLM's is an imported module), so the
    # pool is made by this module imported under its own name.
    from tests.bench import value_engine  # noqa: PLW0406 - see above

    value_engine.serve(Path(sys.argv[1]), sys.argv[2:])
