"""The tree keeper's pass on fixture /proc and cgroup trees: scoped to the trees'
cgroups while every root is in its own, all of /proc every FULL_PASS_EVERY passes
or whenever a root is not (supervisor.trees.keeper); and the proc connector's
watch list on a real socket, with real forks and execs.

A fixture tree because the pass must be shown *not* to read a process that a
full walk would find; the real-process behaviour (setsid grandchildren,
orphans, connector) is in test_trees.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.hostfs import HostFS
from supervisor.plan.keys import ProcKey
from supervisor.plan.placement import Placement
from supervisor.procfs.identity import ProcessId
from supervisor.state import Snapshot, StateStore
from supervisor.topology.discover import read_topology
from supervisor.trees.keeper import FULL_PASS_EVERY, TreeKeeper
from supervisor.trees.proc_events import (
    PROC_EVENT_FORK,
    RATE_WINDOW_S,
    STORM_EVENTS_PER_S,
    STORM_WINDOW_S,
    ProcEvent,
    ProcEvents,
    RawEvent,
    open_proc_events,
    parse_proc_events,
)
from supervisor.trees.quiet import RecentProcs
from tests.support.poll import poll

ENGINE_CG = "sys/fs/cgroup/cpuset/ps/engine"


def write_proc(root: Path, pid: int, ppid: int, start: int = 100) -> None:
    d = root / f"proc/{pid}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(
        f"{pid} (p) S {ppid} {pid} 0 0 0 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0\n"
    )
    (d / "cmdline").write_text(f"p\0{pid}\0")


def write_cgroup(root: Path, pids: list[int]) -> None:
    d = root / ENGINE_CG
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))


def keeper(
    root: Path, recent_procs: RecentProcs | None = None, *, own_cgroups: bool = True
) -> TreeKeeper:
    """A keeper whose engine has ENGINE_CG as its own cgroup; with `own_cgroups`
    False, none of its roots has one (`cgroup = "off"`, attach mode's)."""
    store = StateStore(Snapshot(Placement("test", None, ()), read_topology(HostFS("/")), {}))

    def cgroup_dir(key: ProcKey) -> str | None:
        return ENGINE_CG if key == "engine" and own_cgroups else None

    return TreeKeeper(
        HostFS(str(root)),
        store,
        interval_s=1.0,
        cgroup_dir=cgroup_dir,
        direct_children=list,
        subreaper=False,
        recent_procs=recent_procs,
    )


@pytest.mark.parametrize("named", [True, False], ids=["cgroup-named", "none"])
def test_an_attached_engine_s_named_cgroup_scopes_the_pass_with_no_cgroups_of_its_own(
    tmp_path: Path, named: bool
) -> None:
    """Attach mode: the engine's root comes with the cgroup the operator named
    (read only), and an adopted worker (a root of its own, no cgroup) sits in it:
    every pass after the first reads that cgroup alone. Without it, each pass
    walks all of /proc."""
    write_proc(tmp_path, 1, 0)
    write_proc(tmp_path, 10, 1)  # the engine
    write_proc(tmp_path, 11, 10)  # a worker, adopted as rank 0
    write_proc(tmp_path, 12, 11)  # the worker's child
    write_proc(tmp_path, 90, 1)  # another process of the host
    write_cgroup(tmp_path, [10, 11, 12])

    async def body() -> None:
        trees = keeper(tmp_path, own_cgroups=False)
        trees.set_root("engine", 10, ProcessId(10, 100), cgroup_dir=ENGINE_CG if named else None)
        trees.set_root(0, 11, ProcessId(11, 100), adopted=True)
        for _ in range(3):
            result = await trees.refresh()
            assert set(result.members) == {12}
            assert result.members[12].owner == 0
        assert trees.full_passes == (1 if named else 3)
        assert trees.in_cgroups is named
        await trees.stop()

    asyncio.run(body())


def test_a_pass_reads_only_the_cgroups_while_every_root_is_in_one(tmp_path: Path) -> None:
    write_proc(tmp_path, 1, 0)
    write_proc(tmp_path, 10, 1)  # the engine
    write_proc(tmp_path, 11, 10)  # its child, in its cgroup
    write_proc(tmp_path, 90, 1)  # another process of the host
    write_cgroup(tmp_path, [10, 11])

    async def body() -> None:
        trees = keeper(tmp_path)
        trees.set_root("engine", 10, ProcessId(10, 100))
        first = await trees.refresh()  # the first pass walks all of /proc
        assert set(first.members) == {11}
        assert trees.full_passes == 1
        # A child born in the cgroup is found by a scoped pass; one that someone
        # moved out of our cgroups is not, until the next full pass.
        write_proc(tmp_path, 12, 10)
        write_proc(tmp_path, 13, 10)
        write_cgroup(tmp_path, [10, 11, 12])
        scoped = await trees.refresh()
        assert set(scoped.members) == {11, 12}
        assert trees.full_passes == 1
        for _ in range(FULL_PASS_EVERY - 2):
            await trees.refresh()
        assert trees.full_passes == 1
        full = await trees.refresh()
        assert trees.full_passes == 2
        assert set(full.members) == {11, 12, 13}
        # A known member stays its owner's while scoped, even out of the cgroup.
        again = await trees.refresh()
        assert set(again.members) == {11, 12, 13}
        assert trees.full_passes == 2
        await trees.stop()

    asyncio.run(body())


def _start_time(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[19])


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]


SLEEP = ["sleep", "600"]
INNER_SH = ["sh", "-c", "sleep 600 & wait"]


def _exec_done(pids: list[int], *programs: list[str]) -> list[int] | None:
    """`pids` once they run `programs` (in any order), each its own, not its parent's."""
    argvs = sorted(_argv(p) for p in pids)
    return pids if argvs == sorted(programs) else None


def test_a_worker_being_adopted_stays_out_of_every_published_tree_until_its_root_is_set() -> None:
    """`leaving` takes a worker (and its child) out of the published trees, and
    the passes while its adoption runs (the page move takes seconds) do not put
    it back as the engine's: the check loop would bind it to the engine's CPUs.
    Once it is the rank's root, its child is published in the rank's tree.
    Real processes: an "engine" shell with a sleep and a "worker" shell with one."""
    engine = subprocess.Popen(["sh", "-c", 'sleep 600 & sh -c "sleep 600 & wait" & wait'])
    try:
        # By argv, once each has run exec: a child forked and not yet exec'd
        # still carries its parent's comm and command line.
        kids = poll(lambda: _exec_done(_children(engine.pid), SLEEP, INNER_SH))
        worker = next(k for k in kids if _argv(k) == INNER_SH)
        other = next(k for k in kids if k != worker)
        child = poll(lambda: (_exec_done(_children(worker), SLEEP) or [None])[0])

        async def body() -> None:
            store = StateStore(
                Snapshot(Placement("test", None, ()), read_topology(HostFS("/")), {})
            )
            trees = TreeKeeper(
                HostFS("/"),
                store,
                interval_s=1.0,
                cgroup_dir=lambda key: None,
                direct_children=list,
                subreaper=False,
            )

            def published() -> dict[ProcKey, set[int]]:
                return {k: {m.pid for m in ms} for k, ms in store.snapshot.trees.items()}

            trees.set_root("engine", engine.pid, ProcessId(engine.pid, _start_time(engine.pid)))
            await trees.refresh()
            assert published() == {"engine": {worker, other, child}}
            trees.leaving([worker, child])
            assert published() == {"engine": {other}}
            for _ in range(3):
                await trees.refresh()
                assert published() == {"engine": {other}}
            trees.set_root(0, worker, ProcessId(worker, _start_time(worker)), adopted=True)
            await trees.refresh()
            assert published() == {"engine": {other}, 0: {child}}
            assert trees.leaving_pids == set()
            await trees.stop()

        asyncio.run(body())
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(engine.pid)], check=False)
        engine.kill()
        engine.wait()


def test_a_pass_takes_the_check_loop_s_reading_and_is_skipped_while_nothing_changed(
    tmp_path: Path,
) -> None:
    """With a recent cgroup.procs reading (the check loop's), the keeper reads
    the file no more: a child in the file but not in the reading is found only
    once the reading lists it; a root alone, its reading unchanged, costs no
    pass on the tree thread; a stale reading (none) means the keeper's own read."""
    write_proc(tmp_path, 1, 0)
    write_proc(tmp_path, 10, 1)  # the engine, alone in its cgroup
    write_cgroup(tmp_path, [10])
    reading: dict[str, list[int] | None] = {ENGINE_CG: [10]}

    def recent(rel: str, max_age_s: float) -> list[int] | None:
        assert max_age_s == 1.0  # the check interval
        return reading.get(rel)

    async def body() -> None:
        trees = keeper(tmp_path, recent)
        trees.set_root("engine", 10, ProcessId(10, 100))
        assert (await trees.refresh()).members == {}  # full (the first)
        scanned = await trees.refresh()  # scoped: read on the tree thread
        write_proc(tmp_path, 11, 10)
        write_cgroup(tmp_path, [10, 11])  # in the file, not yet in the loop's reading
        skipped = await trees.refresh()
        assert skipped is scanned and skipped.members == {}  # the same result, nothing read
        reading[ENGINE_CG] = [10, 11]  # the check loop read it
        assert set((await trees.refresh()).members) == {11}
        assert trees.full_passes == 1 and trees.passes == 4
        # A reading too old for the keeper: it reads the file itself.
        trees.members.clear()
        write_proc(tmp_path, 12, 10)
        write_cgroup(tmp_path, [10, 12])
        reading[ENGINE_CG] = None
        assert set((await trees.refresh()).members) == {12}
        await trees.stop()

    asyncio.run(body())


def test_a_quiet_pass_takes_a_reading_as_old_as_quiet_age_s_and_a_scan_a_fresh_one(
    tmp_path: Path,
) -> None:
    """With the proc connector on, the daemon has the check loop read cgroup.procs
    every few checks and widens `quiet_age_s` to match: the quiet pass asks for
    a reading that old; a pass that scans still asks for one a check old."""
    write_proc(tmp_path, 1, 0)
    write_proc(tmp_path, 10, 1)
    write_cgroup(tmp_path, [10])
    asked: list[float] = []

    def recent(rel: str, max_age_s: float) -> list[int] | None:
        asked.append(max_age_s)
        return [10] if max_age_s >= 6.0 else None  # the loop read it 3 s ago

    async def body() -> None:
        trees = keeper(tmp_path, recent)
        trees.quiet_intervals = 6  # of 1 s
        trees.set_root("engine", 10, ProcessId(10, 100))
        await trees.refresh()  # full (the first)
        scoped = await trees.refresh()  # scoped: the keeper reads the file itself
        assert set(asked) == {1.0}
        asked.clear()
        assert await trees.refresh() is scoped  # quiet, on the 3 s old reading
        assert asked == [6.0] and trees.full_passes == 1
        trees.quiet_intervals = 1  # the default: that reading is too old
        assert await trees.refresh() is not scoped
        assert asked[1:] == [1.0, 1.0]
        await trees.stop()

    asyncio.run(body())


def test_every_pass_is_full_while_a_root_is_outside_its_cgroup(tmp_path: Path) -> None:
    write_proc(tmp_path, 1, 0)
    write_proc(tmp_path, 10, 1)
    write_proc(tmp_path, 11, 10)
    write_cgroup(tmp_path, [])  # the engine could not be moved in: its children are not there

    async def body() -> None:
        trees = keeper(tmp_path)
        trees.set_root("engine", 10, ProcessId(10, 100))
        for _ in range(3):
            result = await trees.refresh()
            assert set(result.members) == {11}
        assert trees.full_passes == 3
        await trees.stop()

    asyncio.run(body())


# -- the kernel's watch list (a real proc connector) --------------------------------------

WAITS_THEN_SPAWNS = (
    "import subprocess, sys; sys.stdin.readline(); subprocess.run([sys.executable, '-c', ''])"
)


def collect(events: ProcEvents, until: float) -> list[ProcEvent]:
    out: list[ProcEvent] = []
    events.sock.settimeout(0.1)
    while time.monotonic() < until:
        try:
            out += parse_proc_events(events.sock.recv(65536))
        except TimeoutError:
            continue
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="the proc connector needs root")
def test_the_watch_list_keeps_only_the_listed_processes_forks_and_execs() -> None:
    events, why = open_proc_events()
    assert events is not None, why
    me = os.getpid()
    try:
        assert events.watch({me})
        child = subprocess.Popen([sys.executable, "-c", WAITS_THEN_SPAWNS], stdin=subprocess.PIPE)
        first = collect(events, time.monotonic() + 0.5)
        # Its fork (the parent is listed), not its exec (it is not listed yet).
        assert [(e.kind, e.pid) for e in first if e.pid == child.pid] == [("fork", child.pid)]
        assert events.watch({me, child.pid})
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.close()
        child.wait(10)
        second = collect(events, time.monotonic() + 0.5)
        forks = [e for e in second if e.kind == "fork" and e.parent_tgid == child.pid]
        assert len(forks) == 1  # the grandchild's fork; its own exec is not listed
        grandchild = forks[0].pid
        assert not [e for e in second if e.kind == "exec" and e.pid == grandchild]
        # Nothing of the host's other processes came through.
        for e in first + second:
            listed = {me, child.pid}
            assert (e.parent_tgid if e.kind == "fork" else e.pid) in listed, e
        assert events.watch(None)  # back to every process's events
        assert events.watched is None
    finally:
        events.close()


def storm(duration_s: float) -> tuple[list[int], float]:
    """posix_spawn `true` as fast as it goes for `duration_s`: (pids, forks per second)."""
    pids: list[int] = []
    start = time.monotonic()
    while time.monotonic() - start < duration_s:
        pids.append(os.posix_spawn("/bin/true", ["/bin/true"], {}))
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
    rate = len(pids) / (time.monotonic() - start)
    with contextlib.suppress(ChildProcessError):
        while True:
            os.waitpid(-1, 0)
    return pids, rate


def spawn_one() -> int:
    pid = os.posix_spawn("/bin/true", ["/bin/true"], {})
    os.waitpid(pid, 0)
    return pid


@pytest.mark.skipif(os.geteuid() != 0, reason="the proc connector needs root")
def test_the_loop_reads_a_real_connector_through_a_storm_and_after_it() -> None:
    """`ProcEvents.attach` on a real loop: a fork storm arrives as (what, pid, parent)
    ints with the kernel's numbers, read on the storm's window by a timer; once a
    read finds nothing the socket's reader is back, a later fork is delivered and
    the quiet window is back; a read pending at close never runs."""
    events, why = open_proc_events()
    assert events is not None, why
    me = os.getpid()
    assert events.watch({me})
    got: list[RawEvent] = []

    def forks_of(children: list[int]) -> bool:
        return {(PROC_EVENT_FORK, c, me) for c in children} <= set(got)

    async def until(done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not done():
            assert time.monotonic() < deadline, (len(got), events.batch_window_s)
            await asyncio.sleep(0.01)

    # At each delivery: the window in force, and whether the next read is a timer's.
    reads: set[tuple[float, bool]] = set()

    def deliver(batch: list[RawEvent]) -> None:
        got.extend(batch)
        reads.add((events.batch_window_s, events._timer is not None))

    async def main() -> None:
        events.attach(deliver)
        loop = asyncio.get_running_loop()
        pids, rate = await loop.run_in_executor(None, storm, 3 * RATE_WINDOW_S)
        if rate < 1.5 * STORM_EVENTS_PER_S:
            pytest.skip(f"this host forks {rate:.0f}/s, too slow for a storm")
        await until(lambda: forks_of(pids))
        # The storm was told, and read by a timer on its window; quiet reads
        # leave the next one to the socket's reader.
        assert (STORM_WINDOW_S, True) in reads
        assert (events.quiet_window_s, True) not in reads
        # Nothing more comes: a read finds the socket empty and the reader is back.
        await until(lambda: events._timer is None)
        # Single forks from now on: each is delivered, and once a rate window
        # has passed at their rate, the quiet window is back.
        deadline = time.monotonic() + 10
        while events.batch_window_s != events.quiet_window_s:
            assert time.monotonic() < deadline, "the storm's window never ended"
            later = spawn_one()
            await until(lambda pid=later: forks_of([pid]))
            await asyncio.sleep(0.05)  # forks at a quiet rate (the condition is the loop's)
        # Closed with a read pending: it never runs on the closed socket.
        events.quiet_window_s = events.batch_window_s = 0.2
        spawn_one()
        await until(lambda: events._timer is not None)
        events.close()
        delivered = len(got)
        await asyncio.sleep(0.4)  # past the window: nothing may come (a negative check)
        assert len(got) == delivered and events.overruns == 0

    try:
        asyncio.run(main())
    finally:
        events.close()
