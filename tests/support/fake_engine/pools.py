"""Thread pools made the ways engines make them, for the hook's tests (stdlib only).

`report(pool, n)` runs `n` tasks at once on `pool` and returns what each pool
thread saw of itself: its tid, OS name (comm) and allowed CPUs.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def make_pool(*args: Any, **kwargs: Any) -> ThreadPoolExecutor:
    """A pool created here (this module is what `executors` lists)."""
    return ThreadPoolExecutor(*args, **kwargs)


class CompilerPool(ThreadPoolExecutor):
    """A subclass whose __init__ calls ThreadPoolExecutor's through super()."""

    def __init__(self) -> None:
        super().__init__(max_workers=8, thread_name_prefix="compiler")


def make_compiler_pool() -> CompilerPool:
    """The subclass, created here: the frames of its __init__ chain are skipped."""
    return CompilerPool()


def thread_facts() -> dict[str, Any]:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        comm = f.read().strip()
    return {"tid": threading.get_native_id(), "comm": comm, "cpus": sorted(os.sched_getaffinity(0))}


def report(pool: ThreadPoolExecutor, n: int) -> list[dict[str, Any]]:
    """`n` tasks held at a barrier so each pool thread up to `n` reports once."""
    workers = min(n, pool._max_workers)
    barrier = threading.Barrier(workers, timeout=30)

    def task() -> dict[str, Any]:
        barrier.wait()
        return thread_facts()

    return [f.result() for f in [pool.submit(task) for _ in range(workers)]]
