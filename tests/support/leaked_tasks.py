"""The leaked-task check: a test whose event loop closes with tasks still running fails.

`asyncio.run` and `asyncio.Runner` cancel whatever is still pending when they
close, silently: a task the daemon (or a part a test built) started and never
stopped would vanish there, and in production it would run on, or be torn
down mid-write at interpreter exit. The check wraps the runner's cancel step
(asyncio.runners._cancel_all_tasks, which Runner.close calls by its module
name on Python 3.11-3.13), records the tasks it finds, and the autouse
fixture in tests/conftest.py fails the test that left them, naming each
task and the coroutine it runs. A test that means to leave one behind marks
itself `@pytest.mark.leaks_tasks("why")`.
"""

from __future__ import annotations

import asyncio
import asyncio.runners
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def describe(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
    where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(coro)
    return f"{task.get_name()} ({getattr(code, 'co_qualname', '?')} at {where})"


@contextmanager
def leaked_tasks() -> Iterator[list[str]]:
    """While open: each runner that closes adds the tasks it had to cancel to the list."""
    found: list[str] = []
    original: Callable[[asyncio.AbstractEventLoop], None] = asyncio.runners._cancel_all_tasks  # type: ignore[attr-defined]

    def checked(loop: asyncio.AbstractEventLoop) -> None:
        found.extend(describe(t) for t in asyncio.all_tasks(loop) if not t.done())
        original(loop)

    asyncio.runners._cancel_all_tasks = checked  # type: ignore[attr-defined]
    try:
        yield found
    finally:
        asyncio.runners._cancel_all_tasks = original  # type: ignore[attr-defined]
