"""SIGHUP from `run`'s start to the process's last instruction: a reload request,
never a death (does I/O: the process's signal disposition).

`supervisor.entry` ignores HUP before the heavy imports; `Hangups.install`
replaces that with a handler that notes each HUP until the event loop is
attached, then hands each to the reloader; `close` ignores HUP again for the
rest of the process (asyncio's `remove_signal_handler` would restore the
default, and the interpreter's exit resets a Python handler to the default:
a HUP during the stop or the exit killed the daemon and left its lock file).

The handler is a Python one, not the loop's `add_signal_handler`, so that no
step ever passes through SIG_DFL; it runs in the main thread between bytecodes
and only schedules the reloader's request (loop.call_soon_threadsafe).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from types import FrameType


class Hangups:
    """The SIGHUP handler of one daemon process (see the module's docstring)."""

    def __init__(self) -> None:
        self.early: list[int] = []  # HUPs before a loop was attached
        self._target: tuple[asyncio.AbstractEventLoop, Callable[[int], None]] | None = None
        self.closed = False

    def install(self) -> Hangups:
        signal.signal(signal.SIGHUP, self._on_hup)
        return self

    def attach(self, loop: asyncio.AbstractEventLoop, request: Callable[[int], None]) -> None:
        """From now on each HUP calls `request(signum)` on `loop`."""
        self._target = (loop, request)

    def detach(self) -> None:
        self._target = None

    def close(self) -> None:
        """HUP ignored for the rest of this process (one sigaction: never the default)."""
        self._target = None
        self.closed = True
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _on_hup(self, signum: int, _frame: FrameType | None) -> None:
        target = self._target
        if target is None:
            self.early.append(signum)
            return
        loop, request = target
        try:
            loop.call_soon_threadsafe(request, signum)
        except RuntimeError:  # the loop closed meanwhile: the stop is under way, no reload
            self.early.append(signum)
