"""The fleet: every supervised process of one daemon behind one object (does I/O
through its runners: processes, the executor).

`Fleet` is what the daemon asks of its processes, whoever starts them: start
them (workers gated on the engine's first readiness), their status, lookup by
key, restart requests, the launched wait, liveness for the watchdog, the
direct children and the ordered stop (workers first, then the engine).
`RunnerFleet` is a fleet of `Runner`s over the plan in force; `spawned_fleet`
makes the one whose every process is spawned through the exec shim. The fleet
that adopts engine-spawned workers is `supervisor.trees.adopt.AdoptingFleet`;
another kind (a container runtime's) implements `Fleet` beside them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from supervisor.in_force import PlanInForce
from supervisor.plan.keys import ProcKey
from supervisor.run.runner import Runner, Runtime
from supervisor.run.spec import SpecOf
from supervisor.state import ProcessStatus, Supervised

OnDied = Callable[[BaseException | None], None]


class Fleet(Protocol):
    """The daemon's supervised processes (supervisor.daemon talks to this alone)."""

    @property
    def keys(self) -> tuple[ProcKey, ...]:
        """The planned processes, "engine" first."""
        ...

    def __contains__(self, key: object) -> bool: ...

    def start(self) -> None:
        """Start every process's supervision (on the loop; returns at once)."""
        ...

    def supervised(self) -> list[Supervised]:
        """(key, status, slot in force) of every process: what the check loop checks."""
        ...

    def waiting(self) -> list[str]:
        """What each process still waits for ("engine loading: ..."), for STATUS=."""
        ...

    def child_pids(self) -> list[int]:
        """The daemon's own children among the processes (the subreaper's roots)."""
        ...

    def alive(self) -> bool:
        """False once any process's supervision ended (the watchdog stops petting)."""
        ...

    async def wait_launched(self) -> None:
        """Until every process made its first start (or waits on the engine)."""
        ...

    async def watch(self, on_died: OnDied) -> None:
        """Until the daemon stops; `on_died(exc)` for a supervision that died."""
        ...

    def request_restart(self, key: ProcKey) -> ProcessStatus:
        """Ask `key` to restart; its status before. KeyError when not planned."""
        ...

    async def shutdown(self) -> None:
        """Stop the workers, then the engine; returns when all are down."""
        ...

    def close(self) -> None:
        """Release what the fleet holds (threads); after `shutdown`."""
        ...


class RunnerFleet:
    """A `Fleet` of one `Runner` per planned process (subclasses add who names them)."""

    def __init__(self, rt: Runtime, plan: PlanInForce, runners: Sequence[Runner]) -> None:
        self.rt = rt
        self.plan = plan
        self.runners = tuple(runners)
        self._by_key = {r.key: r for r in self.runners}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(r.label for r in self.runners)})"

    @property
    def keys(self) -> tuple[ProcKey, ...]:
        return tuple(r.key for r in self.runners)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def runner(self, key: ProcKey) -> Runner:
        return self._by_key[key]

    def start(self) -> None:
        engine = self._by_key.get("engine")
        for r in self.runners:
            if engine is not None and r is not engine:
                r.gate = engine  # workers wait for the engine's first readiness
        for r in self.runners:
            r.task = asyncio.create_task(r.run(), name=f"runner-{r.label}")

    def supervised(self) -> list[Supervised]:
        return [(r.key, r.status, self.plan.slot(r.key)) for r in self.runners]

    def waiting(self) -> list[str]:
        return [r.waiting for r in self.runners if r.waiting]

    def child_pids(self) -> list[int]:
        return [r.child.pid for r in self.runners if r.child is not None]

    def alive(self) -> bool:
        return all(r.task is None or not r.task.done() for r in self.runners)

    async def wait_launched(self) -> None:
        await asyncio.gather(*(r.launched.wait() for r in self.runners))

    async def watch(self, on_died: OnDied) -> None:
        stop = asyncio.ensure_future(self.rt.stopping.wait())
        tasks = {r.task for r in self.runners if r.task is not None}
        waits: set[asyncio.Future[Any]] = {stop, *tasks}
        try:
            while not stop.done():
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is stop:
                        continue
                    waits.discard(task)
                    # A runner only returns when stopping; anything else is a bug.
                    if task.cancelled() or task.exception() is not None:
                        on_died(None if task.cancelled() else task.exception())
        finally:
            stop.cancel()

    def request_restart(self, key: ProcKey) -> ProcessStatus:
        runner = self._by_key[key]
        old = runner.status
        runner.request_restart()
        return old

    async def shutdown(self) -> None:
        workers = [r for r in self.runners if r.key != "engine"]
        engine = [r for r in self.runners if r.key == "engine"]
        await asyncio.gather(*(r.shutdown() for r in workers), return_exceptions=True)
        await asyncio.gather(*(r.shutdown() for r in engine), return_exceptions=True)

    def close(self) -> None:
        return None


def spawned_fleet(rt: Runtime, plan: PlanInForce, spec_of: SpecOf) -> RunnerFleet:
    """Every planned process spawned (and restarted) by the daemon through the shim."""
    return RunnerFleet(rt, plan, [Runner(rt, key, spec_of) for key in plan_keys(plan)])


def plan_keys(plan: PlanInForce) -> tuple[ProcKey, ...]:
    """The processes of the plan in force, "engine" first (when planned), then ranks."""
    placement = plan.placement
    head: tuple[ProcKey, ...] = ("engine",) if placement.engine is not None else ()
    return head + tuple(r.rank for r in placement.ranks)
