"""The exec shim: bind this process, report, then execve the worker (does I/O: syscalls).

    python -m supervisor.run.shim --cpus 0-3 --mems 0 [--mempolicy bind|local|preferred|none]
        [--cgroup DIR ...] [--pdeathsig TERM|KILL] [--parent-pid PID]
        [--report-fd N] [--name NAME] [--uid N --gid N [--groups LIST]]
        -- COMMAND [ARG ...]

In order: parent-death signal (then check the parent is still there), join
the cgroups, CPU affinity, memory policy (bind, else preferred, else none;
or local, else none; never fatal), read back, drop to --uid/--gid (binding needs the privileges
the worker should not keep), one JSON line on the report fd, execve. Affinity and
the memory policy are inherited across execve and fork, so the worker and
every thread its runtime starts later (CUDA, HCCL, OpenMP) begin bound: no
preexec_fn, no window where the worker runs unbound.

The report fd is close-on-exec: its EOF tells the supervisor exec happened.
If exec fails, a second line {"exec_error": ..., "errno": ...} follows and the
shim exits 127 (command not found) or 126 (found, not executable).

Start-up cost matters (one shim per worker start), so this module imports
only the standard library's os/sys/errno/ctypes and `supervisor.bind.syscalls`
(no argparse, json, signal, typing: each pulls in re or enum), and writes its
JSON by hand. It needs no site-packages: `supervisor.bind.report.shim_argv`
runs it as `python -I -S -c <stub>`, about half the start-up cost of
`python -m supervisor.run.shim`. `python path/to/shim.py` works too.
"""

from __future__ import annotations

import errno
import os
import sys

if not __package__:  # run as a script (python -I -S path/to/shim.py): find the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from supervisor.bind import syscalls
from supervisor.errors import KernelError

PROG = "supervisor.run.shim"
USAGE = (
    f"usage: {PROG} [--cpus LIST] [--mems LIST] [--mempolicy bind|local|preferred|none]"
    " [--cgroup DIR]... [--pdeathsig TERM|KILL|HUP|INT] [--parent-pid PID]"
    " [--report-fd N] [--name NAME] [--uid N --gid N [--groups LIST]] -- COMMAND [ARG...]"
)
EXIT_USAGE = 2
EXIT_CREDENTIALS = 125  # could not become --uid/--gid: never exec with the old identity
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
# Signal numbers are the same on x86-64 and aarch64 (asm-generic/signal.h);
# spelled out so the shim does not import `signal` (and its enum) at start-up.
SIGNALS = {"HUP": 1, "INT": 2, "KILL": 9, "TERM": 15}
SIGPIPE, SIGXFSZ = 13, 25
MEMPOLICIES = ("bind", "local", "preferred", "none")
_OPTIONS = (
    "--cpus",
    "--mems",
    "--mempolicy",
    "--cgroup",
    "--pdeathsig",
    "--parent-pid",
    "--report-fd",
    "--name",
    "--uid",
    "--gid",
    "--groups",
)


class UsageError(Exception):
    """A bad shim command line (exit 2)."""


class Options:
    __slots__ = (
        "cgroups",
        "command",
        "cpus",
        "gid",
        "groups",
        "mempolicy",
        "mems",
        "name",
        "parent_pid",
        "pdeathsig",
        "report_fd",
        "uid",
    )

    def __init__(self) -> None:
        self.cpus: list[int] | None = None
        self.mems: list[int] | None = None
        self.mempolicy = "bind"
        self.cgroups: list[str] = []
        self.pdeathsig = 0
        self.parent_pid: int | None = None
        self.report_fd: int | None = None
        self.name: str | None = None
        self.uid: int | None = None
        self.gid: int | None = None
        self.groups: list[int] | None = None
        self.command: list[str] = []


def parse_idlist(option: str, text: str) -> list[int]:
    """Parse a kernel-style list "0-3,8" into sorted ids; UsageError names the option."""
    ids: set[int] = set()
    for item in text.split(","):
        lo_text, sep, hi_text = item.strip().partition("-")
        if not lo_text.isdigit() or (sep and not hi_text.isdigit()):
            raise UsageError(f"{option}: bad list {text!r} (expected e.g. 0-3,8)")
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
        if hi < lo or hi >= 1 << 16:
            raise UsageError(f"{option}: bad range {item.strip()!r} in {text!r}")
        ids.update(range(lo, hi + 1))
    return sorted(ids)


def _int(option: str, text: str) -> int:
    if not text.isdigit():
        raise UsageError(f"{option}: expected a non-negative integer, got {text!r}")
    return int(text)


def parse_args(args: list[str]) -> Options:
    """Parse the shim's command line (no argparse: it costs the shim its re import)."""
    opts = Options()
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            opts.command = args[i + 1 :]
            break
        if arg in ("-h", "--help"):
            raise UsageError("help")
        name, eq, value = arg.partition("=")
        if name not in _OPTIONS:
            raise UsageError(f"unknown argument {arg!r} (the command goes after --)")
        if not eq:
            i += 1
            if i >= len(args):
                raise UsageError(f"{name}: expected a value")
            value = args[i]
        if name == "--cpus":
            opts.cpus = parse_idlist(name, value)
        elif name == "--mems":
            opts.mems = parse_idlist(name, value) if value else []
        elif name == "--mempolicy":
            if value not in MEMPOLICIES:
                raise UsageError(f"{name}: expected one of {', '.join(MEMPOLICIES)}, got {value!r}")
            opts.mempolicy = value
        elif name == "--cgroup":
            if not value:
                raise UsageError(f"{name}: expected a directory")
            opts.cgroups.append(value)
        elif name == "--pdeathsig":
            sig = SIGNALS.get(value.upper().removeprefix("SIG"))
            if sig is None and value != "0":
                raise UsageError(f"{name}: expected one of {', '.join(SIGNALS)}, got {value!r}")
            opts.pdeathsig = sig or 0
        elif name == "--parent-pid":
            opts.parent_pid = _int(name, value)
        elif name == "--report-fd":
            opts.report_fd = _int(name, value)
        elif name == "--uid":
            opts.uid = _int(name, value)
        elif name == "--gid":
            opts.gid = _int(name, value)
        elif name == "--groups":
            opts.groups = parse_idlist(name, value) if value else []
        else:
            opts.name = value
        i += 1
    if not opts.command:
        raise UsageError("no command given (put it after --)")
    if opts.cpus is not None and not opts.cpus:
        raise UsageError("--cpus: empty list")
    if (opts.uid is None) != (opts.gid is None):
        raise UsageError("--uid and --gid go together")
    if opts.groups is not None and opts.uid is None:
        raise UsageError("--groups needs --uid and --gid")
    return opts


# -- JSON by hand: `import json` pulls in `re`, a third of the shim's imports.


def _json_str(text: str) -> str:
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            code -= 0x10000
            out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
    out.append('"')
    return "".join(out)


def to_json(value: object) -> str:
    """Serialize None/bool/int/str and lists and str-keyed dicts of them, ASCII only."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _json_str(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_json_str(str(k))}:{to_json(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot serialize {type(value).__name__}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _oserror_text(err: OSError) -> str:
    name = errno.errorcode.get(err.errno or 0, str(err.errno))
    return f"{name} ({err.strerror or err})"


def _say(message: str) -> bool:
    """One line on stderr; False when stderr is gone (nothing else to do then)."""
    try:
        _write_all(2, f"{PROG}: {message}\n".encode("utf-8", "replace"))
    except OSError:
        return False
    return True


def _send(fd: int | None, doc: dict[str, object]) -> None:
    """One JSON line on the report fd; a reader that went away only earns a warning."""
    if fd is None:
        return
    try:
        _write_all(fd, (to_json(doc) + "\n").encode())
    except OSError as err:
        _say(f"warning: cannot write the report to fd {fd}: {_oserror_text(err)}")


def join_cgroups(dirs: list[str]) -> tuple[list[str], list[str], list[int]]:
    """Write our pid into each `<dir>/cgroup.procs`; (joined, errors, their errno
    numbers), never raises.

    Joining a v1 cpuset resets the affinity to the cpuset's CPUs, so this runs
    before sched_setaffinity.
    """
    joined: list[str] = []
    errors: list[str] = []
    numbers: list[int] = []
    pid = str(os.getpid()).encode()
    for directory in dirs:
        path = os.path.join(directory, "cgroup.procs")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        except OSError as err:
            errors.append(f"{directory}: {_oserror_text(err)}")
            numbers.append(err.errno or 0)
        else:
            joined.append(directory)
    return joined, errors, numbers


def apply_mempolicy(wanted: str, mems: list[int] | None) -> tuple[str, str | None, int | None]:
    """The memory-policy ladder: MPOL_BIND to `mems`, else MPOL_PREFERRED to the
    first of them, else none. Returns (step taken, why it is not `wanted`, the
    errno number of the first refusal)."""
    if wanted == "none":
        return "none", None, None
    if wanted == "local":
        # MPOL_LOCAL: pages on the node of the CPU that touches them. The
        # engine's pages stay on its node (its CPUs are there), and a worker it
        # spawns inherits no node: once adopted onto its rank's CPUs, it
        # allocates there (MPOL_BIND would hold it to the engine's node for
        # life: nothing but a cpuset can change another process's policy).
        try:
            syscalls.set_mempolicy(syscalls.MPOL_LOCAL)
            return "local", None, None
        except KernelError as err:
            return "none", f"local failed: {err}", err.errno
    if not mems:
        return "none", "no memory nodes given", None
    reasons: list[str] = []
    number: int | None = None
    if wanted == "bind":
        try:
            syscalls.set_mempolicy(syscalls.MPOL_BIND, mems)
            return "bind", None, None
        except KernelError as err:
            reasons.append(f"bind failed: {err}")
            number = err.errno
    try:
        syscalls.set_mempolicy(syscalls.MPOL_PREFERRED, mems[:1])
        return "preferred", "; ".join(reasons) or None, number
    except KernelError as err:
        reasons.append(f"preferred failed: {err}")
        number = err.errno if number is None else number
    return "none", "; ".join(reasons), number


def apply_binding(opts: Options) -> dict[str, object]:
    """Cgroups, affinity, memory policy, in that order; the report, read back."""
    joined, cg_errors, cg_errnos = join_cgroups(opts.cgroups)
    affinity_error = None
    affinity_errno = None
    if opts.cpus is not None:
        try:
            os.sched_setaffinity(0, opts.cpus)
        except OSError as err:
            affinity_error = _oserror_text(err)
            affinity_errno = err.errno or 0
    step, reason, mempolicy_errno = apply_mempolicy(opts.mempolicy, opts.mems)
    try:
        mems = sorted(syscalls.get_mempolicy()[1])
    except KernelError:
        mems = []
    return {
        "cpus": sorted(os.sched_getaffinity(0)),
        "mems": mems,
        "mempolicy": step,
        "reason": reason,
        "cgroups": joined,
        "cgroup_errors": cg_errors,
        "affinity_error": affinity_error,
        # errno numbers: the supervisor maps them to a reason (errors.reason_of_errno),
        # never the text above (which is for people).
        "cgroup_errnos": cg_errnos,
        "affinity_errno": affinity_errno,
        "mempolicy_errno": mempolicy_errno,
        "pid": os.getpid(),
    }


def drop_privileges(uid: int, gid: int, groups: list[int] | None) -> str | None:
    """Become uid/gid: setgroups, setgid, setuid, in that order (once setuid has
    dropped root, the other two are refused). None, or what failed and why.

    setgroups first so that no supplementary group of root's survives; the
    real, effective and saved ids all change (setresuid), so the worker
    cannot regain root.
    """
    wanted_groups = set(groups if groups is not None else [gid]) - {gid}
    if (
        os.getresuid() == (uid, uid, uid)
        and os.getresgid() == (gid, gid, gid)
        and set(os.getgroups()) - {gid} == wanted_groups
    ):
        return None  # already that account (a supervisor run as the user itself)
    step = f"setgroups({groups if groups is not None else [gid]})"
    try:
        os.setgroups(groups if groups is not None else [gid])
        step = f"setgid({gid})"
        os.setresgid(gid, gid, gid)
        step = f"setuid({uid})"
        os.setresuid(uid, uid, uid)
    except OSError as err:
        return f"{step}: {_oserror_text(err)}"
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        return f"read back uid {os.getresuid()} gid {os.getresgid()}, wanted {uid}/{gid}"
    return None


def _restore_signals() -> None:
    # CPython ignores SIGPIPE and SIGXFSZ; SIG_IGN survives execve: undo it,
    # as subprocess does with restore_signals=True.
    for signum in (SIGPIPE, SIGXFSZ):
        try:
            syscalls.reset_signal_default(signum)
        except KernelError as err:
            _say(f"warning: {err}")


def exec_path(command: list[str], env: dict[str, str] | os._Environ[str]) -> None:
    """execvpe(3) by hand: os.execvpe imports `warnings` lazily, which fails once
    the shim has dropped to a user who cannot read the interpreter's stdlib
    (a Python under root's 0700 home). Raises the first error that is not
    "not in this PATH entry", as execvp does."""
    name = command[0]
    if "/" in name:
        os.execve(name, command, env)
    first: OSError | None = None
    for directory in (env.get("PATH") or os.defpath).split(os.pathsep):
        try:
            os.execve(os.path.join(directory or ".", name), command, env)
        except OSError as err:
            if err.errno not in (errno.ENOENT, errno.ENOTDIR) and first is None:
                first = err
    raise first or FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)


def _arm_pdeathsig(opts: Options) -> bool:
    """Set the parent-death signal; False (after signalling ourselves) when the
    parent is already gone."""
    if not opts.pdeathsig:
        return True
    try:
        syscalls.set_pdeathsig(opts.pdeathsig)
    except KernelError as err:
        _say(f"warning: {err}")
    # prctl(2): if the parent died before PR_SET_PDEATHSIG took effect, no
    # signal ever comes (we were already re-parented): check by hand.
    if opts.parent_pid is not None and os.getppid() != opts.parent_pid:
        _say(f"parent {opts.parent_pid} exited before the shim started; not starting")
        os.kill(os.getpid(), opts.pdeathsig)
        return False
    return True


def main(args: list[str] | None = None) -> int:
    """Bind, report and exec; returns an exit code only when it cannot exec."""
    try:
        opts = parse_args(sys.argv[1:] if args is None else args)
    except UsageError as err:
        if str(err) == "help":
            _write_all(1, (USAGE + "\n" + (__doc__ or "")).encode())
            return 0
        _say(f"error: {err}\n{USAGE}")
        return EXIT_USAGE
    report_fd = opts.report_fd
    if report_fd is not None:
        try:
            # Passed through pass_fds, hence inheritable: make it close-on-exec so
            # that exec closes it, and the supervisor reads EOF at exec.
            os.set_inheritable(report_fd, False)
        except OSError as err:
            _say(f"error: --report-fd {report_fd}: {_oserror_text(err)}")
            return EXIT_USAGE

    if opts.name:
        try:
            syscalls.set_thread_name(opts.name)
        except KernelError as err:
            _say(f"warning: {err}")
    if not _arm_pdeathsig(opts):
        return 1

    report = apply_binding(opts)
    if opts.uid is not None and opts.gid is not None:
        drop_error = drop_privileges(opts.uid, opts.gid, opts.groups)
        report["uid"], report["gid"] = os.getuid(), os.getgid()
        if drop_error is not None:
            report["user_error"] = f"cannot run as uid {opts.uid} gid {opts.gid}: {drop_error}"
            _send(report_fd, report)
            _say(f"error: {report['user_error']}; not starting {opts.command[0]!r}")
            return EXIT_CREDENTIALS
        # commit_creds() clears the parent-death signal when the uid or gid
        # changes (prctl(2), PR_SET_PDEATHSIG): set it again.
        if not _arm_pdeathsig(opts):
            return 1
    _send(report_fd, report)
    _restore_signals()
    command = opts.command
    try:
        exec_path(command, os.environ)
    except OSError as err:
        code = EXIT_NOT_FOUND if err.errno in (errno.ENOENT, errno.ENOTDIR) else EXIT_NOT_EXECUTABLE
        name = errno.errorcode.get(err.errno or 0, str(err.errno))
        _say(f"cannot execute {command[0]!r}: {err.strerror or err} ({name})")
        _send(report_fd, {"exec_error": f"{command[0]}: {err.strerror or err}", "errno": name})
        return code
    return 1  # not reached: exec returns only by raising


if __name__ == "__main__":
    raise SystemExit(main())
