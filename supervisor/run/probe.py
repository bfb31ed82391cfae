"""Engine readiness probes: TCP connect, HTTP GET, or a file appearing (does I/O).

`wait_ready` polls one probe of the config's `[ready]` table until it passes,
the deadline passes, or the engine exits; workers start only after it passes.
Given the engine's pid, a `tcp` probe passes only when the listener belongs
to the engine's process tree (`supervisor.run.listeners`), and `progress` is
called every PROGRESS_INTERVAL_S with the time waited and the last failure.
A check that raises (EMFILE, a /proc read that fails) is "not ready yet",
retried until the timeout like any other failure, and logged once.
`await_ready` is the engine runner's wait on it (supervisor.run.runner), which
keeps the engine's `ProcessStatus.loading` while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import aiohttp

from supervisor.config import ReadyProbe
from supervisor.events import Recorder
from supervisor.hostfs import HostFS
from supervisor.logs import LOGGER_NAME, format_fields
from supervisor.plan.keys import ProcKey
from supervisor.run.listeners import check_listener_owner
from supervisor.run.procs import ChildProcess, first_of
from supervisor.state import Loading, ProcessStatus

log = logging.getLogger(f"{LOGGER_NAME}.probe")

POLL_INTERVAL_S = 0.2
ATTEMPT_TIMEOUT_S = 2.0
PROGRESS_INTERVAL_S = 5.0

Progress = Callable[[float, str], None]
"""Called while waiting: (seconds waited, the last failure)."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ready: bool
    detail: str  # the last failure, or what passed ("tcp 127.0.0.1:8000")
    waited_s: float


def describe_probe(probe: ReadyProbe) -> str:
    if probe.tcp is not None:
        return f"tcp {probe.tcp}"
    if probe.http is not None:
        return f"http {probe.http}"
    return f"file {probe.file}"


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)  # "[::1]:8000"


async def check_tcp(
    address: str, timeout_s: float, owner: tuple[HostFS, int] | None = None
) -> str | None:
    """None when a TCP connection to HOST:PORT opens, else why not.

    With `owner` (a HostFS and the engine's pid), the listening socket must
    also belong to that process or a descendant: checked first, off the loop.
    """
    host, port = split_host_port(address)
    if owner is not None:
        fs, pid = owner
        loop = asyncio.get_running_loop()
        failure = await loop.run_in_executor(None, check_listener_owner, fs, pid, host, port)
        if failure is not None:
            return failure
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except TimeoutError:
        return "connect timed out"
    except OSError as err:
        return err.strerror or str(err)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


async def check_http(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """None when GET `url` answers 2xx, else why not."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if 200 <= resp.status < 300:
                return None
            return f"HTTP {resp.status}"
    except TimeoutError:
        return "request timed out"
    except aiohttp.ClientError as err:
        return str(err) or type(err).__name__


async def check_file(path: str) -> str | None:
    """None when `path` exists (checked in the default executor: it may be on NFS)."""
    exists = await asyncio.get_running_loop().run_in_executor(None, os.path.exists, path)
    return None if exists else "file does not exist yet"


async def wait_ready(
    probe: ReadyProbe,
    alive: Callable[[], bool],
    interval_s: float = POLL_INTERVAL_S,
    *,
    owner: tuple[HostFS, int] | None = None,
    progress: Progress | None = None,
    progress_interval_s: float = PROGRESS_INTERVAL_S,
    attempted: Callable[[str], None] | None = None,
    label: str = "engine",
) -> ProbeResult:
    """Poll `probe` until it passes, `probe.timeout_s` passes, or `alive()` is False.

    `owner`: (HostFS, the engine's pid) for the tcp probe's ownership check.
    An exception from a check is a failed attempt, never the end of the wait:
    a transient error (EMFILE, a racing /proc read) must not fail an engine
    that is loading fine. The first one is logged (`label` names the rank).
    `attempted` is called with each failed attempt's result.
    """
    started = time.monotonic()
    deadline = started + probe.timeout_s
    next_progress = started + progress_interval_s
    detail = "not checked"
    logged_error = False
    session: aiohttp.ClientSession | None = None
    try:
        while True:
            if not alive():
                return ProbeResult(False, "process exited", time.monotonic() - started)
            attempt_s = max(0.05, min(ATTEMPT_TIMEOUT_S, deadline - time.monotonic()))
            try:
                if probe.tcp is not None:
                    failure = await check_tcp(probe.tcp, attempt_s, owner)
                elif probe.http is not None:
                    if session is None:
                        session = aiohttp.ClientSession()
                    failure = await check_http(session, probe.http, attempt_s)
                else:
                    assert probe.file is not None
                    failure = await check_file(probe.file)
            except Exception as err:  # any error is "not ready yet"
                failure = f"probe error: {type(err).__name__}: {err}"
                if not logged_error:
                    logged_error = True
                    log.warning(
                        "ready probe error %s",
                        format_fields(
                            rank=label,
                            probe=describe_probe(probe),
                            error=f"{type(err).__name__}: {err}",
                            timeout_s=f"{probe.timeout_s:g}",
                            action="retry until timeout",
                        ),
                    )
            now = time.monotonic()
            if failure is None:
                return ProbeResult(True, describe_probe(probe), now - started)
            detail = failure
            if attempted is not None:
                attempted(detail)
            if now >= deadline:
                return ProbeResult(False, f"timed out: {detail}", now - started)
            if progress is not None and now >= next_progress:
                next_progress = now + progress_interval_s
                progress(now - started, detail)
            await asyncio.sleep(min(interval_s, max(0.0, deadline - now)))
    finally:
        if session is not None:
            await session.close()


# -- the engine runner's wait ------------------------------------------------------------


class EngineRunner(Protocol):
    """What `await_ready` needs of the engine's runner (supervisor.run.runner.Runner)."""

    key: ProcKey
    label: str
    waiting: str | None  # while the probe waits: "engine loading: ..." (STATUS=)
    interrupt: asyncio.Event
    recorder: Recorder

    @property
    def status(self) -> ProcessStatus: ...

    def set_status(self, **changes: Any) -> ProcessStatus: ...

    def mark_running(self, child: ChildProcess) -> None: ...


async def await_ready(
    runner: EngineRunner,
    probe: ReadyProbe,
    child: ChildProcess,
    exit_future: asyncio.Future[int],
    *,
    fs: HostFS,
    on_state_change: Callable[[], None] | None,
) -> bool:
    """Wait until the engine's probe passes; True when ready or exited.

    While it waits, the engine's status holds `loading` (the probe, since when,
    the timeout, the last attempt's result: /placement, /readyz, `status`), and
    every PROGRESS_INTERVAL_S `runner.waiting` (STATUS=) and a log line say how long.
    """
    described = describe_probe(probe)
    runner.set_status(loading=Loading(described, time.time(), probe.timeout_s))

    def attempted(detail: str) -> None:
        # Each failed attempt (every POLL_INTERVAL_S): stored when it says something new.
        loading = runner.status.loading
        if loading is not None and loading.last != detail:
            runner.set_status(loading=replace(loading, last=detail))

    def progress(waited_s: float, detail: str) -> None:
        runner.waiting = (
            f"{runner.label} loading: {described} not ready after "
            f"{waited_s:.0f}s of {probe.timeout_s:g}s ({detail})"
        )
        log.info(
            "waiting for readiness %s",
            format_fields(
                rank=runner.label,
                pid=child.pid,
                probe=described,
                elapsed_s=f"{waited_s:.0f}",
                timeout_s=f"{probe.timeout_s:g}",
                last=detail,
                action="wait",
            ),
        )
        if on_state_change is not None:
            on_state_change()

    probe_task = asyncio.ensure_future(
        wait_ready(
            probe,
            lambda: not exit_future.done(),
            # The listener must be the engine's own (not a leftover's).
            owner=(fs, child.pid) if fs.is_live else None,
            progress=progress,
            attempted=attempted,
            label=runner.label,
        )
    )
    try:
        await first_of(probe_task, exit_future, runner.interrupt.wait())
    finally:
        runner.waiting = None
        runner.set_status(loading=None)
    if not probe_task.done():
        probe_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probe_task
        return True  # exited, or interrupted: the caller's wait handles it
    result = probe_task.result()
    if result.ready:
        runner.recorder.note(
            "ready",
            runner.key,
            f"{runner.label}: ready ({result.detail}) after {result.waited_s:.1f}s",
            log_message="ready",
            probe=result.detail,
            waited_s=round(result.waited_s, 3),
        )
        runner.mark_running(child)
        return True
    if exit_future.done():
        return True
    runner.recorder.note(
        "ready_failed",
        runner.key,
        f"{runner.label}: readiness probe {described} failed: {result.detail}",
        log_message="ready probe failed",
        level=logging.ERROR,
        probe=described,
        detail=result.detail,
        action="stop",
    )
    return False
