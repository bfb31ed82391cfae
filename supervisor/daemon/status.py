"""What the daemon tells systemd about itself (does socket I/O through the Notifier).

`ServiceStatus` holds the STATUS= summary, READY=1 (at start, and at the end of
a config reload, after RELOADING=1), the log lines of the summary's turns
(degraded, ready) and the WATCHDOG=1 loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Protocol

from supervisor.daemon.sdnotify import Notifier
from supervisor.events import Recorder
from supervisor.logs import format_fields
from supervisor.state import StateStore

log = logging.getLogger("placement_supervisor.daemon")


class FleetView(Protocol):
    """What the status reads of the fleet (supervisor.run.fleet.Fleet has both)."""

    def waiting(self) -> list[str]: ...

    def alive(self) -> bool: ...


class ServiceStatus:
    """STATUS=, READY=1, RELOADING=1 and WATCHDOG=1 of one daemon."""

    def __init__(
        self,
        store: StateStore,
        notifier: Notifier,
        recorder: Recorder,
        fleet: Callable[[], FleetView | None],
        stopping: Callable[[], bool],
    ) -> None:
        self.store = store
        self.notifier = notifier
        self.recorder = recorder
        self.fleet = fleet
        self.stopping = stopping
        self.ready_sent = False
        self._last = ""
        self._was_ready = False

    def line(self) -> str:
        """systemd's STATUS=: "2/3 running; failed: rank 1; not ready" and the like.

        Says which processes are on their way out (stopping: sent TERM, not
        exited), which are down for good (failed, or stopped by their policy),
        what the engine's probe is waiting for, and whether the whole is ready
        (every process running and bound: what /readyz answers).
        """
        snap = self.store.snapshot
        procs = snap.processes
        running = sum(1 for p in procs.values() if p.state == "running")
        parts = [f"{running}/{len(procs)} running"]
        fleet = self.fleet()
        parts += fleet.waiting() if fleet is not None else []
        for state in ("stopping", "failed", "stopped"):
            down = [
                f"rank {k}" if k != "engine" else k for k, p in procs.items() if p.state == state
            ]
            if down:
                parts.append(f"{state}: {', '.join(down)}")
        parts.append("ready" if snap.ready else "not ready")
        if snap.last_reload is not None:  # kept until the next reload
            parts.append(snap.last_reload.summary())
        return "; ".join(parts)

    def publish(self) -> None:
        """systemd STATUS= whenever the summary changes; a log line when some
        process is down for good, when everything becomes ready, and when it
        stops being ready (a process stopping for a restart, say)."""
        status = self.line()
        if status == self._last:
            return
        self._last = status
        self.notifier.status(status)
        snap = self.store.snapshot
        if any(p.state == "failed" for p in snap.processes.values()):
            log.warning("degraded %s", format_fields(status=status, action="stay up"))
        elif snap.ready and not self._was_ready:
            log.info("ready %s", format_fields(status=status))
        elif self._was_ready and not snap.ready:
            log.info("not ready %s", format_fields(status=status))
        self._was_ready = snap.ready

    def notify_ready(self) -> None:
        """READY=1: the API listens and every process is spawned and bound (or
        waits for the engine); the engine's own readiness follows in STATUS=."""
        status = self.line()
        self.ready_sent = True
        self._last = status
        self._was_ready = self.store.snapshot.ready
        self.notifier.ready(status)
        self.recorder.note(
            "ready",
            None,
            f"supervisor started: {status}",
            log_message="supervisor started",
            status=status,
            pid=os.getpid(),
        )

    def reloading(self, path: str | None) -> None:
        """RELOADING=1 (a reload starts); `reloaded` ends it with READY=1."""
        self._last = status = f"reloading {path}"
        self.notifier.reloading(status)

    def reloaded(self) -> None:
        self._last = status = self.line()
        self.notifier.ready(status)

    async def watchdog_loop(self, interval_s: float) -> None:
        """WATCHDOG=1 every interval while the loop runs and every runner is alive."""
        while True:
            fleet = self.fleet()
            if fleet is None or fleet.alive() or self.stopping():
                self.notifier.watchdog()
            await asyncio.sleep(interval_s)
