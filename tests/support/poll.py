"""The suite's one way to wait: poll a predicate until it holds or a deadline passes.

`poll` (fails naming what it waited for), `wait_until` (returns the last value
at the deadline, for a caller that decides), and `until` for a coroutine, whose
event loop keeps running between tries. A test waits on something it can see
(a counter, a file, a process state), never a fixed sleep that hopes the
thing happened; a window in which nothing may happen says so in a comment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.05) -> Any:
    """Poll until `predicate()` is truthy; returns it, or its last (falsy) value at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


def poll(
    predicate: Callable[[], Any],
    timeout_s: float = 20.0,
    interval_s: float = 0.05,
    *,
    what: str | None = None,
) -> Any:
    """Poll until `predicate()` is truthy; returns it, or raises after the deadline."""
    value = wait_until(predicate, timeout_s, interval_s)
    if not value:
        raise AssertionError(f"not within {timeout_s}s: {what or predicate}")
    return value


async def until(
    predicate: Callable[[], Any], timeout_s: float = 20.0, interval_s: float = 0.02
) -> Any:
    """`poll` for a coroutine: the event loop keeps running between tries."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s}s: {predicate}")
        await asyncio.sleep(interval_s)
