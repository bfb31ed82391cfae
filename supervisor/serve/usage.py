"""The supervisor's own CPU time and resident memory, sampled into the snapshot (I/O: /proc/self).

`read_self_usage` asks psutil (two small reads of /proc/self: stat and
statm); `self_usage_loop` publishes a sample every `interval_s`, so the
metrics collector reads the snapshot only and never does I/O in `collect()`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import psutil

from supervisor.state import SelfUsage, StateStore

log = logging.getLogger(__name__)

SELF_USAGE_INTERVAL_S = 5.0  # a third of Prometheus's default 15 s scrape interval


def read_self_usage(process: psutil.Process) -> SelfUsage:
    """One sample of `process` (the daemon's own, `psutil.Process()`)."""
    with process.oneshot():
        cpu = process.cpu_times()
        rss = process.memory_info().rss
    return SelfUsage(cpu.user + cpu.system, rss, time.time())


async def self_usage_loop(
    store: StateStore,
    interval_s: float = SELF_USAGE_INTERVAL_S,
    process: psutil.Process | None = None,
) -> None:
    """Publish `read_self_usage` now and every `interval_s` until cancelled.

    The reads run on the loop: /proc/self/stat and statm are generated from
    the task's own counters in microseconds and never wait on a disk or a lock
    another process holds, so an executor hop would cost more than the read.
    """
    while True:
        try:
            # Made here, not before the loop: psutil.Process() reads /proc/self
            # too, and must not end the sampler when it starts without an fd.
            process = process if process is not None else psutil.Process()
            store.update(self_usage=read_self_usage(process))
        except (psutil.Error, OSError) as err:
            # A self-metric must never take the daemon down; out of file
            # descriptors (EMFILE, open(2); psutil passes it on as a bare
            # OSError) it skips a sample and tries again.
            log.warning("self usage read failed error=%r action=skip", err)
        await asyncio.sleep(interval_s)
