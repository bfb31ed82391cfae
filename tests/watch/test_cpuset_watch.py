"""The live cpuset watch's thread: inotify on the cpuset files, the affinity poll.

Real files, a real v1 cpuset made for the test (removed afterwards), a real
inotify descriptor and the real watch thread; the check loop is stood in for by
the wake callback only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from supervisor.bind.inotify import Inotify
from supervisor.hostfs import HostFS
from supervisor.topology.cgroup import Cpuset, CpusetCache
from supervisor.watch.cpuset_watch import AllowedTrust, WatchState, run_watch, watched_files
from tests.support.cgroup_v1 import v1_available, v1_cpuset
from tests.support.poll import poll


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cache(version: int, rel: str, names: tuple[str, str]) -> CpusetCache:
    found = Cpuset(
        1 if version == 1 else 2,
        "/" + rel,
        frozenset({0}),
        frozenset({0}),
        (f"{rel}/{names[0]}", f"{rel}/{names[1]}"),
    )
    return CpusetCache(found=found)


def test_inotify_says_whether_a_watched_file_was_written(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("0")
    b.write_text("0")
    notify = Inotify()
    try:
        notify.watch([str(a)])
        assert notify.wait(0.05) is False
        b.write_text("1")  # not watched
        assert notify.wait(0.05) is False
        a.write_text("1")
        a.write_text("2")
        assert notify.wait(5) is True
        assert notify.wait(0.05) is False  # both events drained
        notify.watch([str(b)])  # a is no longer watched
        a.write_text("3")
        assert notify.wait(0.05) is False
        with pytest.raises(FileNotFoundError):
            notify.watch([str(tmp_path / "missing")])
    finally:
        notify.close()


def test_watched_files_are_the_writable_ones_up_to_the_hierarchy_root(tmp_path: Path) -> None:
    fs = HostFS(str(tmp_path))
    v1 = "sys/fs/cgroup/cpuset"
    for d in (v1, f"{v1}/docker", f"{v1}/docker/abc"):
        _write(tmp_path, f"{d}/cpuset.cpus", "0-3\n")
        _write(tmp_path, f"{d}/cpuset.mems", "0\n")
        _write(tmp_path, f"{d}/cpuset.effective_cpus", "0-3\n")
    cache = _cache(1, f"{v1}/docker/abc", ("cpuset.effective_cpus", "cpuset.effective_mems"))
    assert watched_files(fs, cache) == tuple(
        str(tmp_path / d / name)
        for d in (f"{v1}/docker/abc", f"{v1}/docker", v1)
        for name in ("cpuset.cpus", "cpuset.mems")
    )
    # v2: the root has no cpuset.cpus; a parent without cpuset delegated ends the walk too.
    v2 = "sys/fs/cgroup/unified"
    _write(tmp_path, f"{v2}/cpuset.cpus.effective", "0-3\n")
    for d in (f"{v2}/svc", f"{v2}/svc/job"):
        _write(tmp_path, f"{d}/cpuset.cpus", "\n")
        _write(tmp_path, f"{d}/cpuset.mems", "\n")
    cache = _cache(2, f"{v2}/svc/job", ("cpuset.cpus.effective", "cpuset.mems.effective"))
    assert watched_files(fs, cache) == tuple(
        str(tmp_path / d / name)
        for d in (f"{v2}/svc/job", f"{v2}/svc")
        for name in ("cpuset.cpus", "cpuset.mems")
    )
    assert watched_files(fs, CpusetCache()) == ()  # nothing resolved yet


@contextmanager
def _watching(
    cache: CpusetCache,
    period_s: float,
    last_cpus: Callable[[], frozenset[int]],
    state: WatchState | None = None,
) -> Iterator[list[float]]:
    """The real watch thread on the live host; yields the times it woke the loop."""
    wakes: list[float] = []
    stop = threading.Event()
    thread = threading.Thread(
        target=run_watch,
        args=(HostFS("/"), cache),
        kwargs={
            "period_s": period_s,
            "last_cpus": last_cpus,
            "wake": lambda: wakes.append(time.monotonic()),
            "stop": stop,
            "state": state,
        },
        daemon=True,
    )
    thread.start()
    try:
        yield wakes
    finally:
        stop.set()


@pytest.mark.timeout(60)
def test_a_cpuset_write_wakes_the_loop_long_before_the_poll(tmp_path: Path) -> None:
    """The poll runs every 30 s here (inotify armed: the period or ARMED_POLL_S,
    the longer): only the write's inotify event can wake the loop within the
    deadline, for cpuset.cpus and cpuset.mems alike, and a write to a child
    (the ranks' cgroups) does not. The watch's state says it is armed and
    counts each change it woke the loop for."""
    why = v1_available()
    if why is not None:
        pytest.skip(why)
    with v1_cpuset(f"ps-watch-{os.getpid()}") as cg:
        child = cg / "rank0"
        child.mkdir()
        (child / "cpuset.mems").write_text("0")
        (child / "cpuset.cpus").write_text("0")
        rel = str(cg.relative_to("/"))
        cache = _cache(1, rel, ("cpuset.effective_cpus", "cpuset.effective_mems"))
        mine = frozenset(os.sched_getaffinity(0))
        state = WatchState()
        with _watching(cache, 30.0, lambda: mine, state) as wakes:

            def woken_by(file: Path, value: str, what: str) -> None:
                # Written again on each poll: the first writes may land before the
                # thread armed its watches (the same value: a no-op for the kernel).
                n = len(wakes)
                poll(lambda: file.write_text(value) and len(wakes) > n, 10, 0.02, what=what)

            (child / "cpuset.cpus").write_text("1")  # v1: a child first on a shrink
            woken_by(cg / "cpuset.cpus", "1", "woken by the cpuset.cpus write")
            woken_by(cg / "cpuset.cpus", "0-1", "woken by the second write")
            woken_by(cg / "cpuset.mems", "0", "woken by the cpuset.mems write")
            time.sleep(0.3)  # a window to observe in, not a synchronisation
            n = len(wakes)
            (child / "cpuset.cpus").write_text("0")
            time.sleep(0.3)
            assert len(wakes) == n, "a write to a child's cpuset woke the loop"
            assert state.armed and state.changes == len(wakes) >= 3


@pytest.mark.timeout(30)
def test_an_affinity_change_wakes_the_loop_at_the_poll(tmp_path: Path) -> None:
    """What writes no file (a hotplug, sched_setaffinity(2)) is the poll's: with
    no cpuset file to watch it runs every period and wakes while the affinity
    differs from the last pass's, and only then."""
    mine = frozenset(os.sched_getaffinity(0))
    last = {"cpus": mine}
    with _watching(CpusetCache(), 0.02, lambda: last["cpus"]) as wakes:
        time.sleep(0.2)
        assert wakes == []
        last["cpus"] = frozenset({-1})  # the last pass started from another set
        poll(lambda: len(wakes) >= 3, 10, 0.01, what="woken while the affinity differs")
        last["cpus"] = mine
        time.sleep(0.1)  # a wake already past its compare may still land
        n = len(wakes)
        time.sleep(0.2)
        assert len(wakes) == n


def test_a_pass_trusts_the_last_allowed_read_only_while_the_armed_watch_saw_nothing() -> None:
    """AllowedTrust: every pass reads the allowed set unless inotify is armed, the
    watch counted no change and the main thread's affinity is the same as at
    the last read; and even then every `every` passes."""
    state, trust = WatchState(), AllowedTrust(every=4)
    cpus = frozenset({0, 1})
    assert [trust.due(state, cpus) for _ in range(3)] == [True] * 3  # not armed
    state.armed = True
    assert [trust.due(state, cpus) for _ in range(5)] == [False, False, False, True, False]
    state.changes += 1  # the watch saw a write (or the affinity move)
    assert [trust.due(state, cpus) for _ in range(2)] == [True, False]
    assert trust.due(state, frozenset({1}))  # the affinity itself differs
    assert not trust.due(state, frozenset({1}))
    state.armed = False  # inotify failed, or the thread ended
    assert trust.due(state, frozenset({1}))
