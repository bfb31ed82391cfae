"""One daemon per config: an flock on a file named for the config's instance (does I/O).

Two daemons of one config would share the rank cgroups and each probe the
other's engine. `hold_instance_lock` takes an exclusive flock(2) on
`<runtime dir>/<instance>.lock` before anything is spawned or any cgroup
touched, and writes the holder's pid into it; a second daemon gets
`InstanceBusy` (exit 2) naming that pid. The kernel drops the lock when the
holder exits, however it exits. The fd is close-on-exec: children never hold it.
A file that outlived its holder (KILL, HUP) holds no lock: the next daemon takes
it over with one log line. `check_instance_env` vets PLACEMENT_SUPERVISOR_INSTANCE.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Mapping

from supervisor.errors import ConfigError
from supervisor.logs import format_fields

log = logging.getLogger("placement_supervisor.daemon")

INSTANCE_ENV = "PLACEMENT_SUPERVISOR_INSTANCE"
# What an explicit instance may hold: it names cgroup dirs and the lock file, and
# systemd's %i (unit names: ASCII letters, digits, ":", "-", "_", ".", "\\",
# systemd.unit(5)) is its usual source; "\\" (systemd-escape) and the rest are
# refused rather than mangled. A newline made every cgroup mkdir fail (EINVAL).
INSTANCE_RE = re.compile(r"[A-Za-z0-9_:@-][A-Za-z0-9_.:@-]{0,199}")
DEFAULT_RUNTIME_DIR = "/run/placement-supervisor"
PID_WAIT_S = 1.0  # the holder writes its pid right after it locks; wait that long for it


class InstanceBusy(ConfigError):
    """Another daemon holds this config's instance lock (exit 2: a second copy is an
    operator's mistake that restarting cannot fix)."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


def check_instance_env(env: Mapping[str, str]) -> str | None:
    """Why INSTANCE_ENV cannot name an instance, or None (unset or "" is the default) (pure)."""
    value = env.get(INSTANCE_ENV)
    if not value or INSTANCE_RE.fullmatch(value):
        return None
    return (
        f"{INSTANCE_ENV}={value!r}: an instance name is 1-200 of A-Z a-z 0-9 _ . : @ - "
        "(not starting with '.'); it names this daemon's cgroup dirs and lock file"
    )


def lock_name(instance: str) -> str:
    """A file name for the instance ("" is the unnamed default instance) (pure)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", instance) or "default"
    if safe != instance and instance:
        # Two instances that differ only in unsafe characters stay apart.
        safe += "-" + hashlib.sha256(instance.encode()).hexdigest()[:8]
    return f"{safe.lstrip('.') or 'default'}.lock"


def systemd_dirs(env: Mapping[str, str], variable: str, default: str, tmp_name: str) -> list[str]:
    """Where a file may live, best first (pure): the first entry of systemd's
    `variable` (RUNTIME_DIRECTORY, STATE_DIRECTORY: systemd.exec(5) sets a
    colon-separated list), the shipped unit's `default`, then a per-user
    `tmp_name-<uid>` in the temp dir."""
    dirs = []
    first = env.get(variable, "").split(":")[0]
    if first:
        dirs.append(first)
    dirs.append(default)
    dirs.append(os.path.join(tempfile.gettempdir(), f"{tmp_name}-{os.getuid()}"))
    return dirs


def runtime_dirs(env: Mapping[str, str]) -> list[str]:
    """Where the lock may live, best first: systemd's RuntimeDirectory=, the
    shipped unit's own /run/placement-supervisor, then a per-user tmp dir."""
    return systemd_dirs(env, "RUNTIME_DIRECTORY", DEFAULT_RUNTIME_DIR, "placement-supervisor")


class InstanceLock:
    """A held lock; `release()` removes the file and drops the lock."""

    __slots__ = ("fd", "path")

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    def release(self) -> None:
        if self.fd < 0:
            return
        atexit.unregister(self.release)
        # Unlink while still holding it: a daemon that opened the old file
        # sees it is no longer at `path` and retries (see _try_lock).
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> InstanceLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def usable_dir(path: str) -> bool:
    """`path` exists (made 0700 if not), is a directory of ours or root's, and is writable."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    # Another user's dir in /tmp could hold a link to a file of ours.
    owned = st.st_uid in (os.getuid(), 0)
    return stat.S_ISDIR(st.st_mode) and owned and os.access(path, os.W_OK | os.X_OK)


def _read_pid(fd: int) -> int | None:
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit():
            return int(text)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def _try_lock(path: str) -> int | None:
    """The locked fd of `path`, or None when another process holds it (pid left in
    InstanceBusy by the caller). Raises OSError when the file cannot be opened."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
            raise _Busy(fd) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder unlinked it as we opened it: take the new one


def _note_stale(fd: int, path: str) -> None:
    """One log line when the file we just locked names an earlier holder: a daemon
    that was killed (KILL, HUP) or exited before removing it. Nobody holds its
    flock, so it is stale whatever that pid is now (dead, or reused by another
    program); we take it over."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    if not text:
        return
    pid = int(text) if text.isdigit() else None
    alive = False
    if pid is not None:
        try:
            os.kill(pid, 0)
            alive = True
        except PermissionError:
            alive = True
        except OSError:
            alive = False
    log.info(
        "instance lock stale %s",
        format_fields(
            path=path,
            pid=pid if pid is not None else text[:16],
            pid_alive="yes (another process: it holds no lock)" if alive else "no",
            action="take over",
        ),
    )


class _Busy(Exception):
    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd


def hold_instance_lock(instance: str, env: Mapping[str, str], what: str) -> InstanceLock:
    """Lock `instance` for this process; InstanceBusy naming the holder's pid when
    another daemon has it. `what` names the config in the message."""
    name = lock_name(instance)
    errors = []
    for d in runtime_dirs(env):
        if not usable_dir(d):
            errors.append(d)
            continue
        path = os.path.join(d, name)
        try:
            fd = _try_lock(path)
        except _Busy as busy:
            pid = _read_pid(busy.fd)
            os.close(busy.fd)
            holder = f"pid {pid}" if pid is not None else "a process that wrote no pid"
            raise InstanceBusy(
                f"{what}: another daemon ({holder}) already runs this config "
                f"(instance lock {path}); stop it first, or give this one another "
                "PLACEMENT_SUPERVISOR_INSTANCE",
                pid,
            ) from None
        except OSError as err:
            errors.append(f"{path}: {err.strerror or err}")
            continue
        assert fd is not None
        _note_stale(fd, path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        lock = InstanceLock(fd, path)
        # Every exit of the interpreter removes the file, an error raised after
        # the lock (exit 2, 3) included; only a signal's death (KILL, HUP)
        # leaves it, and the next start takes it over (_note_stale).
        atexit.register(lock.release)
        return lock
    raise ConfigError(f"{what}: no directory for the instance lock: {'; '.join(errors)}")
