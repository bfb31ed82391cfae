"""The leaked-task check itself (tests/support/leaked_tasks.py): it must see a
task left running when a loop closes, and nothing when every task was stopped."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from tests.support.leaked_tasks import leaked_tasks


async def _sleeper() -> None:
    await asyncio.sleep(3600)


@pytest.mark.leaks_tasks("it leaves one on purpose")
def test_a_task_left_running_is_named() -> None:
    async def main() -> None:
        asyncio.get_running_loop().create_task(_sleeper(), name="forgotten")
        await asyncio.sleep(0)

    with leaked_tasks() as found:
        asyncio.run(main())
    assert len(found) == 1 and found[0].startswith("forgotten (_sleeper at "), found


def test_a_task_stopped_before_the_loop_closes_is_not_a_leak() -> None:
    async def main() -> None:
        task = asyncio.get_running_loop().create_task(_sleeper())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with leaked_tasks() as found, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    assert found == []


@pytest.mark.leaks_tasks("it leaves one on purpose")
def test_uvloop_runners_are_checked_too() -> None:
    async def main() -> None:
        asyncio.get_running_loop().create_task(_sleeper(), name="left")
        await asyncio.sleep(0)

    with leaked_tasks() as found, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    assert [f.split(" ")[0] for f in found] == ["left"]
