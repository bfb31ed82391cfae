"""The grammar-compile pool of the fake engine: vLLM's shape, real xgrammar (I/O: files).

`StructuredOutputManager.__init__` in vllm/v1/structured_output/__init__.py
makes `ThreadPoolExecutor(max_workers=(cpu_count + 1) // 2)` with no name
prefix and submits grammar compiles to it; xgrammar's GrammarCompiler then
starts `max_threads` fresh std::threads per compile (cpp/grammar_compiler.cc).
This module does the same with a vocabulary built in memory (no hub download).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

VOCAB = [chr(c) for c in range(32, 127)] + ['{"', '"}', '": ', "true", "false", "null"]
VOCAB += [f"tok{i}" for i in range(4000)]  # big enough that each compile starts threads


def schema(i: int) -> str:
    props: dict[str, Any] = {"a": {"type": "string"}, "n": {"type": "integer"}}
    for k in range(i % 7 + 1):
        props[f"k{i}_{k}"] = {"type": "array", "items": {"type": "number"}}
    return json.dumps({"type": "object", "properties": props, "required": ["a"]})


def compile_until(out: Path, compiler_threads: int) -> None:
    """Compile schemas on an unnamed pool until `out/stop` exists.

    Writes `out/pool.json` (max_workers as the pool ended up, this pid, and
    the threads that existed before the pool: `import torch` starts one from
    the main thread) once the first compile ran on a pool thread, then
    `out/compiled` with the number of compiles.
    """
    import xgrammar as xgr  # noqa: PLC0415 - imports torch: only in the compiling process

    info = xgr.TokenizerInfo(encoded_vocab=VOCAB)
    compiler = xgr.GrammarCompiler(info, max_threads=compiler_threads, cache_enabled=False)
    before = sorted(int(t) for t in os.listdir("/proc/self/task"))
    # vLLM sizes it (cpu_count + 1) // 2, already 1 on a 2-CPU test box;
    # 4 x cpu_count so the plan's cap has something to cut.
    pool = ThreadPoolExecutor(max_workers=multiprocessing.cpu_count() * 4)
    pool.submit(compiler.compile_json_schema, schema(0)).result()
    ready = {"max_workers": pool._max_workers, "pid": os.getpid(), "before": before}
    (out / "pool.json").write_text(json.dumps(ready))
    count = 0
    deadline = time.monotonic() + 120  # never outlive a test that died
    while not (out / "stop").exists() and time.monotonic() < deadline:
        futures = [pool.submit(compiler.compile_json_schema, schema(i)) for i in range(8)]
        for f in futures:
            f.result()
        count += len(futures)
    pool.shutdown()
    (out / "compiled").write_text(str(count))
