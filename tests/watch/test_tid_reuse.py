"""Tid reuse (issue 11): the check loop never writes a tid that now names another process.

The reproduction of the issue, with real processes: a supervised process's
thread exits and another starts (the thread count is unchanged), and the
exited thread's tid goes to an unrelated `taskset -c 1 sleep`. The tid is
steered with /proc/sys/kernel/ns_last_pid inside a private pid namespace
(`unshare --pid --fork --mount-proc`), so nothing else on the host takes it.
Before the fix the loop re-bound the sleep onto the worker's CPU 0.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType

import pytest

from supervisor.bind.binder import Binder
from supervisor.config import Config, DriftConfig, ProcessConfig
from supervisor.hostfs import HostFS
from supervisor.in_force import PlanInForce
from supervisor.plan.placement import Placement, Slot
from supervisor.procfs.identity import ProcessId, ThreadId
from supervisor.state import ProcessStatus, Snapshot, StateStore
from supervisor.topology.discover import read_topology
from supervisor.watch.apply import Applier
from supervisor.watch.decide import ThreadBind
from supervisor.watch.loop import CheckLoop

REPO = Path(__file__).resolve().parents[2]
FS = HostFS("/")

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell the bind apart"
)

# Starts and stops threads on command; each thread is a named, sleeping thread.
THREADS_CHILD = r"""
import sys, threading
stops = {}
def work(stop):
    stop.wait()
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "start":
        stop, ready = threading.Event(), threading.Event()
        box = []
        def run(stop=stop, ready=ready, box=box):
            box.append(threading.get_native_id()); ready.set(); work(stop)
        t = threading.Thread(target=run, name="worker", daemon=True)
        t.start(); ready.wait()
        stops[box[0]] = (stop, t)
        print(box[0], flush=True)
    elif cmd == "stop":
        stop, t = stops.pop(int(arg)); stop.set(); t.join()
        print("stopped", flush=True)
"""


class Child:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["taskset", "-c", "0", sys.executable, "-c", THREADS_CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def affinity(tid: int) -> set[int]:
    return set(os.sched_getaffinity(tid))


def check_loop(pid: int, start_time: int | None, slot: Slot) -> tuple[CheckLoop, StateStore]:
    topology = read_topology(FS)
    ident = None if start_time is None else ProcessId(pid, start_time)
    status = ProcessStatus(0, "running", pid=pid, id=ident)
    placement = Placement("test", None, ())
    store = StateStore(Snapshot(placement, topology, MappingProxyType({0: status})))
    loop = CheckLoop(
        store=store,
        plan=PlanInForce(
            Config(None, None, ProcessConfig(()), drift=DriftConfig(check_interval_s=0.05)),
            topology,
            placement,
        ),
        fs=FS,
        executor=ThreadPoolExecutor(1),
        supervised=lambda: [(0, store.snapshot.processes[0], slot)],
        stopping=asyncio.Event(),
        applier=Applier(FS, Binder(FS), None, None),
    )
    return loop, store


async def reuse(pid: int, tid: int) -> subprocess.Popen[bytes]:
    """`taskset -c 1 sleep 60` started with pid `tid`, once the thread is gone."""
    for _ in range(200):  # join() returns before the kernel has released the tid
        if not os.path.exists(f"/proc/{pid}/task/{tid}"):
            break
        await asyncio.sleep(0.01)
    for _ in range(20):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(tid - 1))
        proc = subprocess.Popen(["taskset", "-c", "1", "sleep", "60"])
        if proc.pid == tid:
            for _ in range(200):  # until taskset has exec'd sleep with CPU 1
                if Path(f"/proc/{tid}/comm").read_text().strip() == "sleep":
                    return proc
                await asyncio.sleep(0.01)
        proc.kill()
        proc.wait()
    raise AssertionError(f"could not get pid {tid} for the unrelated process")


def scenario() -> None:
    """Run inside a private pid namespace (see the module docstring)."""
    child = Child()
    sleeper: subprocess.Popen[bytes] | None = None
    try:
        pid = child.proc.pid
        first = int(child.ask("start"))
        stat = Path(f"/proc/{pid}/stat").read_text()
        start_time = int(stat.rpartition(")")[2].split()[19])
        loop, store = check_loop(pid, start_time, Slot((0,), (0,), {"main": (0,)}))

        async def main() -> None:
            for _ in range(3):  # the thread is known and placed
                await loop.check_once()
            assert first in loop.tracked[0].state.placed
            # The thread exits; its tid goes to an unrelated process, then a new
            # thread of the child starts: the thread count is unchanged.
            assert child.ask(f"stop {first}") == "stopped"
            nonlocal sleeper
            sleeper = await reuse(pid, first)
            assert affinity(first) == {1}
            second = int(child.ask("start"))
            assert second != first
            for _ in range(5):
                await loop.check_once()
            assert affinity(first) == {1}, "the loop re-bound an unrelated process"
            assert affinity(second) == {0}
            rebinds = [e for e in store.snapshot.events if e.kind == "rebind"]
            assert not any(first in e.fields.get("tids", ()) for e in rebinds)
            assert all(t.tid != first for t in store.snapshot.observed[0].threads)

        asyncio.run(main())
        print("PASS tid reuse", flush=True)
    finally:
        child.close()
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()


@pytest.mark.timeout(120)
def test_a_reused_tid_is_never_rebound() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("needs root and unshare(1) (a private pid namespace)")
    done = subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            "from tests.watch.test_tid_reuse import scenario; scenario()",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0 and "PASS tid reuse" in done.stdout, done.stdout + done.stderr


def test_the_applier_never_writes_a_tid_of_another_process() -> None:
    child = Child()
    other = subprocess.Popen(["taskset", "-c", "1", "sleep", "60"])
    try:
        child.ask("start")
        applier = Applier(FS, Binder(FS), None, None)
        # A bind for a tid that is not (any more) a thread of the child.
        out = applier.bind_thread(
            child.proc.pid, ThreadBind(other.pid, "worker", "main", (0,), "thread_affinity")
        )
        assert out.gone and out.error is None
        assert affinity(other.pid) == {1}
        # A thread of the child with the wrong start time (its tid reused).
        tid = int(child.ask("start"))
        stale = ThreadBind(tid, "worker", "main", (1,), "thread_affinity", id=ThreadId(tid, 1))
        assert applier.bind_thread(child.proc.pid, stale).gone
        assert affinity(tid) == {0}
        # The same thread, named right: bound.
        right = ThreadBind(tid, "worker", "main", (1,), "thread_affinity")
        assert applier.bind_thread(child.proc.pid, right).kept == (1,)
        assert affinity(tid) == {1}
    finally:
        child.close()
        other.kill()
        other.wait()
