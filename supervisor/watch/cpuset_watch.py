"""The live host's fast cpuset watch: a plain thread that wakes the check loop (does I/O).

`run_watch` polls one sched_getaffinity(2) of the main thread, whose
Cpus_allowed is what the pass reads from /proc/self/status: a cpuset write
(v1, and v2, which narrows each task's mask to the new effective CPUs) or a
CPU hotplug (the mask is reported ∩ the active CPUs) changes it. It also
watches, with inotify(7), the writable cpuset files (cpuset.cpus,
cpuset.mems) of the supervisor's cgroup and of each ancestor: vfs_write
notifies IN_MODIFY for cgroupfs files as for any file (fs/read_write.c), so
a cpuset write wakes the pass at once, memory nodes included. The effective_*
files the pass reads are changed by the kernel itself and never notify, and a
hotplug or a sched_setaffinity(2) writes no file: those still need the poll.
With inotify armed it runs every ARMED_POLL_S only: what it alone sees, the
check pass sees as soon (it compares the main thread's affinity each pass),
and each wake of a Python thread cost ~200 us of CPU on a quiet 2-core VM (at
200 ms the poll was an eighth of the idle daemon's cost, issue 17 item 6).

`WatchState` is what the thread tells the pass: whether inotify is armed and
how many changes it has seen. `AllowedTrust` says when the pass may trust the
allowed set it last read instead of reading it again (supervisor.watch.loop).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import threading
import time
from collections.abc import Callable

from supervisor.bind.inotify import Inotify
from supervisor.hostfs import HostFS
from supervisor.topology.cgroup import CGROUP_ROOT, CpusetCache

ARMED_POLL_S = 1.0  # the poll with inotify armed (what writes no file: hotplug, setaffinity)
MAX_ANCESTORS = 32
ALLOWED_REREAD_PASSES = 10  # with the watch armed and quiet, still read this often


class WatchState:
    """Written by the watch thread, read by the pass (single attribute stores: no lock)."""

    __slots__ = ("armed", "changes")

    def __init__(self) -> None:
        self.armed = False  # inotify watches every cpuset file the last pass read
        self.changes = 0  # cpuset writes and affinity changes seen, ever


class AllowedTrust:
    """Whether a pass reads the allowed set (3 of a quiet pass's ~20 file reads).

    It trusts the last read while the watch's inotify is armed and has seen
    no write or affinity change since, and the main thread's affinity is what
    it was then: every way the set changes shows there (a cpuset write
    notifies, v2's effective sets change only by a write up the tree; a
    hotplug or a setaffinity moves the affinity). Every `every` passes it
    reads anyway.
    """

    __slots__ = ("_last", "_trusted", "every")

    def __init__(self, every: int = ALLOWED_REREAD_PASSES) -> None:
        self.every = every
        self._last: tuple[int, frozenset[int]] | None = None  # (changes, cpus) at the last read
        self._trusted = 0  # passes in a row that trusted it

    def forget(self) -> None:
        """The next pass reads the allowed set whatever the watch says (the set the
        loop compares with was replaced: a plan made from an older read)."""
        self._last = None

    def due(self, state: WatchState, cpus: frozenset[int]) -> bool:
        """True: read the allowed set this pass (and remember this as the last read)."""
        now = (state.changes, cpus)
        self._trusted += 1
        if state.armed and now == self._last and self._trusted < self.every:
            return False
        self._last, self._trusted = now, 0
        return True


def watched_files(fs: HostFS, cache: CpusetCache) -> tuple[str, ...]:
    """The writable cpuset files of the cgroup whose files the last pass read
    (`cache`) and of its ancestors, as absolute paths; () when none is known.
    The walk stops below the first dir without a cpuset.cpus (a v2 root, or
    the mount's parent)."""
    found = cache.found
    if found is None or not found.files:
        return ()
    out: list[str] = []
    rel = posixpath.dirname(found.files[0])
    for _ in range(MAX_ANCESTORS):
        if not rel.startswith(CGROUP_ROOT + "/") or not fs.exists(f"{rel}/cpuset.cpus"):
            break
        out.extend(fs.path(f"{rel}/{name}") for name in ("cpuset.cpus", "cpuset.mems"))
        rel = posixpath.dirname(rel)
    return tuple(out)


def _arm(notify: Inotify | None, paths: tuple[str, ...]) -> bool:
    """Watch `paths`; False when inotify cannot (the poll then runs at full rate)."""
    if notify is None or not paths:
        return False
    try:
        notify.watch(paths)
    except OSError:
        return False
    return True


def run_watch(
    fs: HostFS,
    cache: CpusetCache,
    *,
    period_s: float,
    last_cpus: Callable[[], frozenset[int]],
    wake: Callable[[], None],
    stop: threading.Event,
    state: WatchState | None = None,
) -> None:
    """The watch thread's body: call `wake` (thread-safe) whenever the main
    thread's affinity differs from `last_cpus()` (what the last pass started
    from) or a watched cpuset file was written; until `stop`. `state` says
    whether inotify is armed and counts what was seen."""
    state = state if state is not None else WatchState()
    pid = os.getpid()  # the main thread's tid: /proc/self/status describes it
    try:
        notify: Inotify | None = Inotify()
    except OSError:
        notify = None  # no inotify (a seccomp profile, the instance limit): poll only
    known = cache.found  # the resolution `paths` come from
    paths = watched_files(fs, cache)
    armed = state.armed = _arm(notify, paths)
    try:
        while not stop.is_set():
            written = False
            if armed and notify is not None:
                try:
                    written = notify.wait(max(period_s, ARMED_POLL_S))
                except OSError:
                    armed = state.armed = False
            else:
                time.sleep(period_s)
            found = cache.found  # replaced (never changed) by the pass's thread
            if found is not known and (
                found is None or known is None or found.files != known.files
            ):  # the pass found its cpuset elsewhere: watch there
                known, paths = found, watched_files(fs, cache)
                armed = state.armed = _arm(notify, paths)
            try:
                moved = os.sched_getaffinity(pid) != last_cpus()  # a set == a frozenset
            except OSError:
                moved = False  # the pass reads and reports the allowed set
            if moved or written:
                state.changes += 1
            if (moved or written) and not stop.is_set():
                try:
                    wake()
                except RuntimeError:
                    return  # the loop is closed: the daemon is stopping
    finally:
        state.armed = False
        if notify is not None:
            notify.close()


def start_watch(
    fs: HostFS,
    cache: CpusetCache,
    loop: asyncio.AbstractEventLoop,
    event: asyncio.Event,
    *,
    period_s: float,
    last_cpus: Callable[[], frozenset[int]],
    stop: threading.Event,
    state: WatchState | None = None,
) -> threading.Thread:
    """`run_watch` in a daemon thread named allowed_watch, waking `event` on `loop`."""
    thread = threading.Thread(
        target=run_watch,
        args=(fs, cache),
        kwargs={
            "period_s": period_s,
            "last_cpus": last_cpus,
            "wake": lambda: loop.call_soon_threadsafe(event.set),
            "stop": stop,
            "state": state,
        },
        name="allowed_watch",
        daemon=True,
    )
    thread.start()
    return thread
