"""inotify(7) through ctypes: which of a few files were written (does I/O: syscalls).

`Inotify` holds one non-blocking inotify descriptor watching a set of files
for IN_MODIFY; `wait(timeout_s)` blocks in poll(2) until one is written or the
time is up and drains the events. Used by the fast cpuset watch
(supervisor.watch.cpuset_watch). Every OSError comes out as the kernel gave it.
"""

from __future__ import annotations

import ctypes
import os
import select
from collections.abc import Iterable

IN_MODIFY = 0x00000002  # <sys/inotify.h>: the file was written
IN_NONBLOCK = os.O_NONBLOCK  # inotify_init1(2) takes the O_ flags' values
IN_CLOEXEC = os.O_CLOEXEC
_EVENTS_BYTES = 4096  # struct inotify_event (16 bytes) + a name: none here (files, not dirs)

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(result: int) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


class Inotify:
    """One inotify descriptor and the files it watches for writes (not thread-safe:
    one owner thread)."""

    def __init__(self) -> None:
        self.fd = _check(_lib().inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
        self.paths: tuple[str, ...] = ()
        self._wds: list[int] = []
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    def watch(self, paths: Iterable[str]) -> None:
        """Watch exactly `paths` for IN_MODIFY from now on. Raises OSError when a
        path cannot be watched (the ones before it stay watched)."""
        for wd in self._wds:
            _lib().inotify_rm_watch(self.fd, wd)  # an already removed file: EINVAL, fine
        self._wds = []
        self.paths = ()
        self._drain()  # the removals' IN_IGNORED events: no write of a watched file
        wanted = tuple(paths)
        for path in wanted:
            self._wds.append(
                _check(_lib().inotify_add_watch(self.fd, os.fsencode(path), IN_MODIFY))
            )
        self.paths = wanted

    def wait(self, timeout_s: float) -> bool:
        """Block until a watched file is written or `timeout_s` passed; True when
        one was (every pending event is read)."""
        if not self._poll.poll(max(0, int(timeout_s * 1000))):
            return False
        return self._drain()

    def _drain(self) -> bool:
        """Read every pending event; True when there was one."""
        fired = False
        while True:
            try:
                data = os.read(self.fd, _EVENTS_BYTES)
            except BlockingIOError:
                return fired
            if not data:
                return fired
            fired = True

    def close(self) -> None:
        os.close(self.fd)
