"""Child processes: spawn in their own process group, wait, signal, stop (does I/O).

A `ChildProcess` is a direct child of the daemon, started with
`start_new_session=True` (its own session and process group, so a signal to
the group reaches everything it started) and without `preexec_fn` (binding is
done by the exec shim in the child itself). Its identity is a pidfd
(pidfd_open(2)) held from spawn to reap: signals go through the pidfd, and
the group is only signalled while the leader is not yet reaped, so a pid the
kernel has handed to someone else is never signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, Literal

from supervisor.errors import KernelError, translate_oserror
from supervisor.procfs.identity import open_pidfd


def _deliver(target: str, send: Callable[[], None]) -> bool:
    """Send one signal; False when the process is already gone, other errors translated."""
    try:
        send()
    except ProcessLookupError:
        return False
    except OSError as err:
        raise translate_oserror(target, err) from None
    return True


class ChildProcess:
    """One spawned child; the daemon reaps it (`wait`) and never anyone else.

    Until `wait` has reaped it, the child's pid (and so its process group id)
    cannot be reused: the kernel keeps a zombie's pid. Exit is noticed through
    the pidfd becoming readable, then the child is looked at with
    waitid(WNOWAIT), its leftover group members are killed while the zombie
    still pins the group id, and only then is it reaped.
    """

    def __init__(self, popen: subprocess.Popen[bytes], pidfd: int | None) -> None:
        self._popen = popen
        self._pidfd = pidfd
        self.pid = popen.pid
        self.pgid = popen.pid  # start_new_session: the child leads its own group
        self.spawned_at = time.monotonic()
        self._exit: asyncio.Future[int] | None = None
        self._watcher: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"ChildProcess(pid={self.pid}, returncode={self.returncode})"

    @property
    def returncode(self) -> int | None:
        """The exit status once reaped (negative: killed by that signal)."""
        return self._popen.returncode

    # -- waiting -------------------------------------------------------------

    def wait(self) -> asyncio.Future[int]:
        """A future of the exit status; the same future on every call."""
        if self._exit is not None:
            return self._exit
        loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        if self._popen.returncode is not None:
            self._exit.set_result(self._popen.returncode)
        elif self._pidfd is not None:
            # A pidfd polls readable once the process exits (pidfd_open(2)).
            loop.add_reader(self._pidfd, self._on_pidfd_readable)
        else:
            # No pidfd: one thread blocks in waitid(WNOWAIT) for this child only.
            thread = threading.Thread(
                target=self._wait_thread, args=(loop,), name=f"wait-{self.pid}", daemon=True
            )
            self._watcher = thread
            thread.start()
        return self._exit

    def _on_pidfd_readable(self) -> None:
        exited = self._exited()
        if exited is not None:
            loop = asyncio.get_running_loop()
            assert self._pidfd is not None
            loop.remove_reader(self._pidfd)
            self._finish(zombie=exited == "zombie")

    def _wait_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        zombie = True
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            zombie = False
        loop.call_soon_threadsafe(self._finish, zombie)

    def _exited(self) -> Literal["zombie", "reaped"] | None:
        """ "zombie" (exited, its pid and group id still ours), "reaped" (someone
        else waited for it: the ids may be reused already), or None (running)."""
        try:
            result = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return "reaped"
        return None if result is None else "zombie"

    def _finish(self, zombie: bool = True) -> None:
        if self._popen.returncode is None:
            if zombie:
                # The zombie still pins the group id: kill what the child left
                # behind (as systemd's KillMode=control-group would), then
                # reap. Without it the id may be someone else's: leave it.
                with contextlib.suppress(KernelError):
                    self._signal_group_unchecked(signal.SIGKILL)
            self._popen.wait()
        self._close_pidfd()
        if self._exit is not None and not self._exit.done():
            assert self._popen.returncode is not None
            self._exit.set_result(self._popen.returncode)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    # -- signals -------------------------------------------------------------

    def send_signal(self, sig: int) -> bool:
        """Signal the process itself; False when it has already exited."""
        if self._popen.returncode is not None:
            return False
        send = (
            partial(signal.pidfd_send_signal, self._pidfd, sig)
            if self._pidfd is not None
            else partial(os.kill, self.pid, sig)
        )
        return _deliver(f"pid {self.pid}", send)

    def signal_group(self, sig: int) -> bool:
        """Signal the whole process group; False when it has already been reaped."""
        if self._popen.returncode is not None:
            return False
        return self._signal_group_unchecked(sig)

    def _signal_group_unchecked(self, sig: int) -> bool:
        return _deliver(f"process group {self.pgid}", partial(os.killpg, self.pgid, sig))

    async def stop(self, timeout_s: float, sig: int = signal.SIGTERM) -> int:
        """TERM the group, KILL it after `timeout_s`, and reap; returns the exit status."""
        exit_future = self.wait()
        if not exit_future.done():
            with contextlib.suppress(KernelError):  # a denied TERM still leaves KILL below
                self.signal_group(sig)
            try:
                await asyncio.wait_for(asyncio.shield(exit_future), timeout_s)
            except TimeoutError:
                with contextlib.suppress(KernelError):
                    self.signal_group(signal.SIGKILL)
        return await exit_future

    def close(self) -> None:
        """Release the pidfd of a child that will never be waited for (errors only)."""
        self._close_pidfd()


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    pass_fds: Sequence[int] = (),
    cwd: str | None = None,
) -> ChildProcess:
    """Start `argv` in a new session (own process group), stdin from /dev/null.

    Call from the thread that lives as long as the daemon (the event loop's):
    PR_SET_PDEATHSIG, which the shim sets in the child, fires when the *thread*
    that forked the child exits, not the process (prctl(2)), so a spawn from a
    pool thread could kill the child when that thread is retired.
    stdout and stderr are the daemon's own (the journal under systemd).
    Raises OSError when the executable itself cannot be started.
    """
    popen = subprocess.Popen(
        list(argv),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        close_fds=True,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
        cwd=cwd,
    )
    try:
        pidfd = open_pidfd(popen.pid)
    except OSError:
        # Cannot happen for an unreaped child of ours; do not leak it if it does.
        popen.kill()
        popen.wait()
        raise
    return ChildProcess(popen, pidfd)


async def read_until_eof(fd: int, timeout_s: float, limit_bytes: int = 1 << 16) -> bytes:
    """Read a pipe until EOF (every writer closed it) or `timeout_s`; closes `fd`.

    The shim's report pipe: its write end is close-on-exec in the child, so
    EOF means the child exec'd its command (or died). On timeout what was read
    so far is returned.
    """
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    total = 0
    done: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        nonlocal total
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data or total >= limit_bytes:
                if not done.done():
                    done.set_result(None)
                return
            chunks.append(data)
            total += len(data)

    loop.add_reader(fd, on_readable)
    try:
        await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        pass
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return b"".join(chunks)[:limit_bytes]


# -- waiting ------------------------------------------------------------------------


async def first_of(*waits: Awaitable[Any]) -> None:
    """Wait until the first of `waits` completes.

    Coroutines (and gathers) given here are wrapped and cancelled afterwards;
    futures and tasks the caller passes in (a child's exit) are left alone.
    """
    futures: list[asyncio.Future[Any]] = []
    owned: list[asyncio.Future[Any]] = []
    for w in waits:
        if isinstance(w, asyncio.Future):
            futures.append(w)
        else:
            wrapped: asyncio.Future[Any] = asyncio.ensure_future(w)
            futures.append(wrapped)
            owned.append(wrapped)
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in owned:
            f.cancel()
