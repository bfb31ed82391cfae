"""What `run` would fail on, checked before it runs (`plan --config`, and `run` at start; I/O).

One message each, naming the file, the key and the value: a command missing, or
not executable or its `python -m` module not importable as its `user` would run
it; an unknown account; a bad PLACEMENT_SUPERVISOR_INSTANCE; argv + environment
over the kernel's limits; (plan only) a bad token file, a taken port.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import stat
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from supervisor.bind.report import shim_argv
from supervisor.config import Config
from supervisor.daemon.instance_lock import check_instance_env
from supervisor.errors import ConfigError
from supervisor.listen import parse_listen
from supervisor.plan.placement import Placement
from supervisor.run.spec import PYTHON_NAMES, build_specs, resolve_python
from supervisor.run.users import Account, resolve_account


class PreflightFailed(ConfigError):
    """`run` refuses to start: one problem a line (cli.py prints each as an error)."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = tuple(problems)


def refuse(problems: Sequence[str]) -> None:
    """PreflightFailed (exit 2) when there is any problem."""
    if problems:
        raise PreflightFailed(problems)


def check_command(
    where: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    python: str,
    account: Account | None = None,
) -> str | None:
    """Why `argv` cannot start, or None. `where` is "FILE: engine.command".

    With `account`, as that user would exec it: the file and every directory
    above it (and a script's `#!` interpreter), and `python -m` modules
    importable by that interpreter running as that user."""
    word = argv[0]
    if "{" in word:  # a worker template's first word is filled per rank: not checkable here
        return None
    resolved = resolve_python(argv, python)[0]
    if "/" in resolved:
        candidates = [resolved]
        if not os.path.exists(resolved):
            return f"{where}: {word!r} does not exist"
    else:
        search = env.get("PATH", os.defpath)
        candidates = _on_path(resolved, search)
        if not candidates:
            return f"{where}: {word!r} is not found on PATH ({search})"
    path = candidates[0]
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        return f"{where}: {path} is not an executable file"
    if account is not None:
        # The shim's execvpe goes on past a PATH entry the user may not use (EACCES).
        usable = [c for c in candidates if _user_problem(c, account) is None]
        if not usable:
            return f"{where}: {_user_problem(path, account)}"
        path = usable[0]
    module = python_module(argv)
    if module is None or not PYTHON_RE.fullmatch(os.path.basename(path)):
        return None
    return _check_module(where, word, path, module, env=env, account=account)


def _on_path(name: str, search: str) -> list[str]:
    """Every executable file `name` on `search`, in order (what execvp(3) tries)."""
    out = []
    for directory in search.split(os.pathsep):
        candidate = os.path.join(directory or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            out.append(candidate)
    return out


def python_module(argv: Sequence[str]) -> str | None:
    """The module of `python [OPTIONS] -m MODULE ...`, or None (pure)."""
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        word = argv[i]
        if word == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if word.startswith("-m"):
            return word[2:]
        if word in {"-c", "-"}:
            return None
        i += 2 if word in ("-W", "-X") else 1
    return None


def user_can(path: str, mode: int, account: Account) -> bool | None:
    """access(2) of `path` as `account`, or None when this process cannot become it.

    access(2) is the kernel's own check: the search (x) permission of every
    directory on the way, the file's bits, POSIX ACLs and a noexec mount for
    X_OK (fs/open.c do_faccessat), so a fork that takes the account's ids and
    asks is exact where a reading of mode bits would not be. Call before any
    thread starts (plan, and `run` before its event loop)."""
    ours = account.uid == os.geteuid() and account.gid == os.getegid()
    if ours:
        return os.access(path, mode, effective_ids=True)
    if os.geteuid() != 0:
        return None  # the shim cannot drop to it either: it exits 125 and says so
    if threading.active_count() > 1:
        return _user_can_exec(path, mode, account)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's exit code is the answer
        code = 3
        try:
            os.setgroups(list(account.groups))
            os.setresgid(account.gid, account.gid, account.gid)
            os.setresuid(account.uid, account.uid, account.uid)
            code = 0 if os.access(path, mode) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return None if code not in (0, 1) else code == 0


def _user_can_exec(path: str, mode: int, account: Account) -> bool | None:
    """user_can from a process with threads (a reload): a bare fork(2) there may
    copy a lock another thread holds, so test(1) is exec'd as the account instead
    (subprocess's fork+exec runs no Python in the child). test -x/-r is access(2)
    with the real ids, which the account's are (coreutils euidaccess)."""
    flag = "-x" if mode == os.X_OK else "-r"
    test = shutil.which("test", path="/usr/bin:/bin")
    if test is None:
        return None
    try:
        done = subprocess.run(
            [test, flag, path],
            env={},
            user=account.uid,
            group=account.gid,
            extra_groups=list(account.groups),
            timeout=MODULE_CHECK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None  # the account cannot run test(1): as when it cannot be become
    return None if done.returncode not in (0, 1) else done.returncode == 0


def _user_problem(path: str, account: Account) -> str | None:
    """Why `account` cannot exec `path` (or its `#!` interpreter), or None."""
    who = f"user {account.user!r} (uid {account.uid})"
    if user_can(path, os.X_OK, account) is False:
        return (
            f"{path} is not executable by {who}: the file's or a directory's "
            "permissions above it refuse it (execve EACCES, exit 126)"
        )
    interpreter = _shebang(path)
    if interpreter is None:
        return None
    if user_can(path, os.R_OK, account) is False:
        return f"{path} is a script that {who} cannot read (its interpreter opens it)"
    if user_can(interpreter, os.X_OK, account) is False:
        return f"{path}: its interpreter {interpreter} is not executable by {who}"
    return None


def _shebang(path: str) -> str | None:
    """The interpreter a `#!` line names, or None for a binary (binfmt_script)."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].split()
    return os.fsdecode(words[0]) if words else None


# Run by the command's own interpreter: is MODULE there, without running any
# package's __init__ on the way (PathFinder over each parent's __path__, as
# runpy would find it)? Only when that finds nothing is the real find_spec
# asked, which imports the parents (a package that extends its __path__).
FIND_MODULE = """
import importlib.machinery as m, importlib.util as u, sys
def walk(name):
    parts = name.split(".")
    spec = u.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None, ".".join(parts[:i])
        spec = m.PathFinder.find_spec(".".join(parts[: i + 1]), spec.submodule_search_locations)
    return spec, name
def find(name):
    spec, missing = walk(name)
    if spec is None:
        try:
            spec = u.find_spec(name)
        except Exception:
            spec = None
    if spec is None:
        print(missing)
        sys.exit(1)
    return spec
name = sys.argv[1]
if find(name).submodule_search_locations is not None:
    find(name + ".__main__")
"""
MODULE_CHECK_TIMEOUT_S = 60.0
PYTHON_RE = re.compile(r"python[0-9.]*")


def _check_module(
    where: str,
    word: str,
    interpreter: str,
    module: str,
    *,
    env: Mapping[str, str],
    account: Account | None,
) -> str | None:
    """Why `interpreter -m module` (as `account`) would find no module, or None."""
    as_user: dict[str, Any] = {}
    if account is not None and os.geteuid() == 0 and account.uid != 0:
        as_user = {"user": account.uid, "group": account.gid, "extra_groups": account.groups}
    try:
        done = subprocess.run(
            [interpreter, "-c", FIND_MODULE, module],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=MODULE_CHECK_TIMEOUT_S,
            check=False,
            **as_user,
        )
    except subprocess.TimeoutExpired:
        limit = f"{MODULE_CHECK_TIMEOUT_S:.0f} s"
        return f"{where}: {interpreter} did not say within {limit} whether it has {module!r}"
    except OSError as err:
        return f"{where}: cannot run {interpreter}: {err.strerror or err}"
    if done.returncode == 0:
        return None
    missing = done.stdout.strip() or module
    top = module.split(".", maxsplit=1)[0]
    if word in PYTHON_NAMES and missing == top:
        return (
            f"{where}: `{word} -m {module}` runs under the supervisor's own interpreter "
            f"({interpreter}), which has no module {top!r}; name the engine environment's "
            f"interpreter instead (e.g. /opt/{top}/bin/python)"
        )
    if done.returncode != 1:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{where}: {interpreter} cannot check module {module!r}: {error}"
    return f"{where}: `{word} -m {module}`: {interpreter} has no module {missing!r}"


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


# fs/exec.c: each argv/envp string is at most MAX_ARG_STRLEN (32 pages,
# include/uapi/linux/binfmts.h); all of them, NULs and one pointer each
# included, at most a quarter of the stack rlimit and never over 3/4 of
# _STK_LIM (8 MiB) (bprm_stack_limits). sysconf(_SC_ARG_MAX) is that quarter.
STK_LIM_BYTES = 8 << 20
# The cgroup dirs the shim is given are known only at the first spawn.
CGROUP_ARGS_BYTES = 2 * 512


def arg_limits() -> tuple[int, int]:
    """(bytes per string, bytes of argv + envp in all) for an execve from this process."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = min(os.sysconf("SC_ARG_MAX"), STK_LIM_BYTES // 4 * 3)
    return 32 * page, total


def check_arg_size(
    where: str, argv: Sequence[str], env: Mapping[str, str], limits: tuple[int, int]
) -> str | None:
    """Why execve(argv, env) would fail with E2BIG, or None (pure)."""
    per_string, total_max = limits
    strings = [*argv, *(f"{k}={v}" for k, v in env.items())]
    total = sum(len(s.encode()) + 1 for s in strings) + 8 * len(strings) + CGROUP_ARGS_BYTES
    for text in strings:
        size = len(text.encode()) + 1
        if size > per_string:
            what = text.split("=", 1)[0] if text in strings[len(argv) :] else text[:40] + "..."
            return (
                f"{where}: {what!r} is {size} bytes, over the kernel's {per_string} per "
                "argument or variable (MAX_ARG_STRLEN; execve E2BIG, 'Argument list too long')"
            )
    if total > total_max:
        return (
            f"{where}: its arguments and environment are {total} bytes, over the kernel's "
            f"{total_max} (ARG_MAX: a quarter of the stack limit; execve E2BIG, "
            "'Argument list too long')"
        )
    return None


def check_spawns(
    config: Config, placement: Placement, env: Mapping[str, str], python: str
) -> list[str]:
    """The argv + environment of each process, as the daemon builds them
    (shim included), against the kernel's limits; one message per process."""
    file = config.path or "<config>"
    accounts = _accounts(config)
    limits = arg_limits()
    problems: list[str] = []
    for spec in build_specs(config, placement, env, python):
        if not spec.argv:
            continue  # a rank the engine spawns (spawned_by = "engine"): adopted, not execed
        name = "engine" if spec.key == "engine" else "workers"
        account = accounts.get(name)
        child_env = {**spec.env, **account.env()} if account is not None else dict(spec.env)
        argv = shim_argv(
            python,
            spec.slot.cpus,
            spec.slot.mems,
            spec.argv,
            report_fd=1023,
            parent_pid=os.getpid(),
            pdeathsig="KILL",
            user=account.shim_user if account is not None else None,
        )
        label = "engine" if spec.key == "engine" else f"rank {spec.key}"
        problem = check_arg_size(f"{file}: {name} ({label})", argv, child_env, limits)
        if problem is not None:
            problems.append(problem)
    return problems


def _accounts(config: Config) -> dict[str, Account]:
    """The accounts that resolve (a bad one is reported by `check_processes`)."""
    out = {}
    for name, proc in (("engine", config.engine), ("workers", config.workers)):
        if proc is not None and proc.user is not None:
            with contextlib.suppress(ConfigError):
                out[name] = resolve_account(proc.user, proc.group, name)
    return out


def check_processes(
    config: Config,
    env: Mapping[str, str],
    python: str,
    placement: Placement | None = None,
) -> list[str]:
    """What `run` refuses at start, one message each: the instance name, each
    account, each command (as its account would exec it), and, with a
    placement, each process's argv + environment size."""
    file = config.path or "<config>"
    problems: list[str] = []
    instance = check_instance_env(env)
    if instance is not None:
        problems.append(instance)
    accounts = _accounts(config)
    for name, proc in (("engine", config.engine), ("workers", config.workers)):
        if proc is None:
            continue
        # Workers the engine spawns (spawned_by = "engine") have no command of ours.
        if proc.command:
            account = accounts.get(name)
            # The command's environment as child_env builds it: the config's are defaults.
            proc_env = {**proc.env, **env, **(account.env() if account is not None else {})}
            where = f"{file}: {name}.command"
            problem = check_command(where, proc.command, proc_env, python, account)
            if problem is not None:
                problems.append(problem)
        if proc.user is not None:
            try:
                resolve_account(proc.user, proc.group, f"{file}: {name}")
            except ConfigError as err:
                problems.append(str(err))
    if placement is not None:
        problems.extend(check_spawns(config, placement, env, python))
    return problems


def check_config(
    config: Config,
    env: Mapping[str, str],
    python: str,
    *,
    listen: str | None = None,
    placement: Placement | None = None,
) -> list[str]:
    """Every problem `run --config` would hit on this host, one message each."""
    file = config.path or "<config>"
    problems = check_processes(config, env, python, placement)
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
