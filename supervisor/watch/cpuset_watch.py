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
hotplug or a sched_setaffinity(2) writes no file: those still need the poll,
which with inotify armed runs INOTIFY_POLL_FACTOR times less often (each wake
of a Python thread measured ~45 us of CPU on a loaded 2-core VM: at 50 ms
the poll was the largest single part of the idle check loop's cost).
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

INOTIFY_POLL_FACTOR = 4  # the 50 ms default polls every 200 ms: inside the 250 ms target
MAX_ANCESTORS = 32


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
) -> None:
    """The watch thread's body: call `wake` (thread-safe) whenever the main
    thread's affinity differs from `last_cpus()` (what the last pass started
    from) or a watched cpuset file was written; until `stop`."""
    pid = os.getpid()  # the main thread's tid: /proc/self/status describes it
    try:
        notify: Inotify | None = Inotify()
    except OSError:
        notify = None  # no inotify (a seccomp profile, the instance limit): poll only
    known = cache.found  # the resolution `paths` come from
    paths = watched_files(fs, cache)
    armed = _arm(notify, paths)
    try:
        while not stop.is_set():
            written = False
            if armed and notify is not None:
                try:
                    written = notify.wait(period_s * INOTIFY_POLL_FACTOR)
                except OSError:
                    armed = False
            else:
                time.sleep(period_s)
            found = cache.found  # replaced (never changed) by the pass's thread
            if found is not known and (
                found is None or known is None or found.files != known.files
            ):  # the pass found its cpuset elsewhere: watch there
                known, paths = found, watched_files(fs, cache)
                armed = _arm(notify, paths)
            try:
                moved = os.sched_getaffinity(pid) != last_cpus()  # a set == a frozenset
            except OSError:
                moved = False  # the pass reads and reports the allowed set
            if (moved or written) and not stop.is_set():
                try:
                    wake()
                except RuntimeError:
                    return  # the loop is closed: the daemon is stopping
    finally:
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
        },
        name="allowed_watch",
        daemon=True,
    )
    thread.start()
    return thread
