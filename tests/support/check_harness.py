"""The check loop without a daemon: a harness for supervisor.watch.loop's tests.

The daemon brings a shim, runners, restarts, an API, a guardian and a tree
keeper; a test of what the check loop finds and repairs needs none of them.
`checking` builds the loop from its real parts (the plan holder, the state
store, the one bind path with a real Binder, an executor) around processes
the test starts itself, runs the loop at the config's interval, and stops it
through its `stopping` event when the test is done. The processes are real,
their threads are read from /proc and bound with sched_setaffinity(2): only
the daemon around them is left out. Each starts on its slot's main CPUs, as
the shim would start it (the memory policy left out), so its later threads
inherit them and the loop finds what it finds under the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from supervisor.bind.binder import Binder
from supervisor.config import Config
from supervisor.cpulist import format_cpulist
from supervisor.hostfs import HostFS
from supervisor.in_force import PlanInForce
from supervisor.plan.keys import ProcKey
from supervisor.plan.placement import Placement
from supervisor.procfs.identity import ProcessId
from supervisor.state import ProcessStatus, Snapshot, StateStore, Supervised
from supervisor.topology.model import Topology
from supervisor.watch.apply import Applier
from supervisor.watch.loop import CheckLoop
from tests.support.poll import until

FS = HostFS("/")


@dataclass
class CheckHarness:
    """The loop, its store and the processes it checks (key -> Popen)."""

    checker: CheckLoop
    store: StateStore
    procs: Mapping[ProcKey, subprocess.Popen[bytes]]

    def pid(self, key: ProcKey) -> int:
        return self.procs[key].pid

    def counter(self, name: str, label: tuple[str, ...]) -> int:
        table: dict[Any, int] = dict(getattr(self.store.snapshot.counters, name))
        return table.get(label, 0)

    def events(self, kind: str, key: ProcKey | None = None) -> list[Any]:
        return [
            e
            for e in self.store.snapshot.events
            if e.kind == kind and (key is None or e.key == key)
        ]

    async def checks(self, n: int) -> None:
        """Wait for `n` more passes of the running loop to finish."""
        start = self.store.snapshot.counters.checks
        await until(lambda: self.store.snapshot.counters.checks >= start + n)


@contextlib.asynccontextmanager
async def checking(
    config: Config,
    topology: Topology,
    placement: Placement,
    commands: Mapping[ProcKey, Sequence[str]],
) -> AsyncIterator[CheckHarness]:
    """The check loop running over `commands`, one process per key of the plan;
    every process killed and the loop stopped (its tasks ended) on the way out."""
    procs: dict[ProcKey, subprocess.Popen[bytes]] = {}
    executor = ThreadPoolExecutor(2, thread_name_prefix="ps-harness")
    stopping = asyncio.Event()
    task: asyncio.Task[None] | None = None
    try:
        plan = PlanInForce(config, topology, placement)
        for key, argv in commands.items():
            # taskset(1) sets the CPUs before the program's first instruction, as the shim.
            main = format_cpulist(plan.slot(key).role_cpus("main"))
            procs[key] = subprocess.Popen(["taskset", "-c", main, *argv], env=dict(os.environ))
        statuses = {
            key: ProcessStatus(key, "running", p.pid, id=ProcessId.read(FS, p.pid))
            for key, p in procs.items()
        }
        store = StateStore(Snapshot(placement, topology, MappingProxyType(statuses)))

        def supervised() -> list[Supervised]:
            snap = store.snapshot
            return [(key, snap.processes[key], plan.slot(key)) for key in procs]

        checker = CheckLoop(
            store=store,
            plan=plan,
            fs=FS,
            executor=executor,
            supervised=supervised,
            stopping=stopping,
            applier=Applier(FS, Binder(FS), None, None),
        )
        task = asyncio.create_task(checker.run(), name="check-loop")
        yield CheckHarness(checker, store, procs)
    finally:
        stopping.set()
        checker_task_done = task is None
        if task is not None:
            checker.wake.set()  # out of its wait now, not at the next interval
            await asyncio.wait_for(task, 30)
            checker_task_done = True
        for p in procs.values():
            p.kill()
            p.wait()
        executor.shutdown(wait=True)
        assert checker_task_done
