"""What `run` would fail on, checked before it runs (`plan --config`; does I/O).

Each check gives one message naming the config file, the key and the value:
a command that is not there or not executable (PATH resolved as `run` would,
`python` meaning the supervisor's interpreter, and the module `python -m`
names importable by it), an account that does not exist, a token file that
is unreadable, empty or readable by others, a port (the API's, the engine's
`ready.tcp`) another program already listens on.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import socket
import stat
from collections.abc import Mapping, Sequence

from supervisor.config import Config
from supervisor.errors import ConfigError
from supervisor.run.spec import PYTHON_NAMES, resolve_python
from supervisor.run.users import resolve_account
from supervisor.serve.listen import parse_listen


def check_command(
    where: str, argv: Sequence[str], env: Mapping[str, str], python: str
) -> str | None:
    """Why `argv` cannot start, or None. `where` is "FILE: engine.command"."""
    word = argv[0]
    if "{" in word:  # a worker template's first word is filled per rank: not checkable here
        return None
    resolved = resolve_python(argv, python)[0]
    if "/" in resolved:
        path = resolved
        if not os.path.exists(resolved):
            return f"{where}: {word!r} does not exist"
    else:
        found = shutil.which(resolved, path=env.get("PATH", os.defpath))
        if found is None:
            return f"{where}: {word!r} is not found on PATH ({env.get('PATH', os.defpath)})"
        path = found
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        return f"{where}: {path} is not an executable file"
    if word in PYTHON_NAMES and len(argv) > 2 and argv[1] == "-m":
        top = argv[2].split(".")[0]
        if importlib.util.find_spec(top) is None:
            return (
                f"{where}: `{word} -m {argv[2]}` runs under the supervisor's own interpreter "
                f"({python}), which has no module {top!r}; name the engine environment's "
                f"interpreter instead (e.g. /opt/{top}/bin/python)"
            )
    return None


def check_token_file(where: str, path: str) -> str | None:
    """Why the bearer token file would not do, or None: readable, not empty, private."""
    try:
        # O_NONBLOCK: a FIFO here must not hang `plan --config` (fifo(7)).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        return f"{where}: {path}: cannot read: {err.strerror or err}"
    try:
        info = os.fstat(fd)
        # Only a regular file is read: a FIFO with a writer would give EAGAIN.
        token = os.read(fd, 4096).strip() if stat.S_ISREG(info.st_mode) else b""
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode):
        return f"{where}: {path} is not a regular file"
    if not token:
        return f"{where}: {path} is empty"
    if info.st_mode & 0o077:
        mode = stat.S_IMODE(info.st_mode)
        return f"{where}: {path} is readable by others (mode {mode:04o}); chmod 600 {path}"
    return None


def check_port_free(where: str, host: str, port: int) -> str | None:
    """Why host:port cannot be listened on, or None (port 0 is always free)."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"{where}: cannot resolve {host!r}: {err.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As a server would bind: TIME_WAIT leftovers do not count as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return f"{where}: {host}:{port} is already in use by another program"
            return f"{where}: cannot listen on {host}:{port}: {err.strerror or err}"
    return None


def check_config(
    config: Config, env: Mapping[str, str], python: str, *, listen: str | None = None
) -> list[str]:
    """Every problem `run --config` would hit on this host, one message each."""
    file = config.path or "<config>"
    problems: list[str] = []
    for name, proc in (("engine", config.engine), ("workers", config.workers)):
        if proc is None:
            continue
        # Workers the engine spawns (spawned_by = "engine") have no command of ours.
        problem = (
            check_command(f"{file}: {name}.command", proc.command, env, python)
            if proc.command
            else None
        )
        if problem is not None:
            problems.append(problem)
        if proc.user is not None:
            try:
                resolve_account(proc.user, proc.group, f"{file}: {name}")
            except ConfigError as err:
                problems.append(str(err))
    if config.api.token_file is not None:
        problem = check_token_file(f"{file}: api.token_file", config.api.token_file)
        if problem is not None:
            problems.append(problem)
    api = parse_listen(listen, "api.listen") if listen else config.api.listen
    if api.path is None and api.host is not None:
        where = "--listen" if listen else f"{file}: api.listen"
        problem = check_port_free(where, api.host, api.port)
        if problem is not None:
            problems.append(problem)
    if config.ready is not None and config.ready.tcp is not None:
        host, _, port = config.ready.tcp.rpartition(":")
        problem = check_port_free(
            f"{file}: ready.tcp (the engine must be the one to listen there)",
            host.strip("[]"),
            int(port),
        )
        if problem is not None:
            problems.append(problem)
    return problems
