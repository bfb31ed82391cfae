"""The spawner's side of the exec shim: its command line and its report (pure, no I/O).

`shim_argv` builds the argv that starts a worker through `supervisor.run.shim`;
`parse_shim_report` reads what the shim wrote on its report fd (one JSON line
after binding, a second one if exec failed). Kept apart from the shim itself,
which must not import json or dataclasses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast, get_args

import supervisor
from supervisor.plan.placement import Slot
from supervisor.state import MemPolicyStep

PDEATHSIGS = ("TERM", "KILL", "HUP", "INT")
# The directory that holds the `supervisor` package, and a one-line program that
# runs the shim from it under `python -I -S -c`: the module then comes from its
# cached .pyc (a script path would be recompiled on every start).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(supervisor.__file__)))
SHIM_STUB = (
    f"import sys;sys.path.insert(0,{PACKAGE_ROOT!r});"
    "from supervisor.run.shim import main;sys.exit(main())"
)


class ShimReportError(ValueError):
    """The report fd held no report, or garbage."""


@dataclass(frozen=True, slots=True)
class ShimReport:
    """What the shim bound before exec, as the kernel read it back.

    `exec_error`/`errno` are set when exec failed (the shim then exits 127/126);
    `user_error` when it could not become the configured user (exit 125: it
    never execs as root instead). `uid`/`gid` are read back after the drop.
    `mems` are the nodes of the memory policy in force ([] for none).
    """

    cpus: tuple[int, ...]
    mems: tuple[int, ...]
    mempolicy: MemPolicyStep
    reason: str | None = None
    cgroups: tuple[str, ...] = ()
    cgroup_errors: tuple[str, ...] = ()
    affinity_error: str | None = None
    # errno numbers of the failures above (0 where the shim had none to give)
    cgroup_errnos: tuple[int, ...] = ()
    affinity_errno: int | None = None
    mempolicy_errno: int | None = None
    pid: int | None = None
    exec_error: str | None = None
    errno: str | None = None
    uid: int | None = None
    gid: int | None = None
    user_error: str | None = None

    @property
    def exec_failed(self) -> bool:
        """The command never ran: exec failed, or the user could not be taken."""
        return self.exec_error is not None or self.user_error is not None

    @property
    def degraded(self) -> bool:
        """True when something planned was not applied (policy, cgroup or affinity)."""
        return bool(self.reason or self.cgroup_errors or self.affinity_error)


def _ints(doc: dict[str, Any], key: str) -> tuple[int, ...]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ShimReportError(f"shim report: {key!r} must be a list of integers, got {value!r}")
    return tuple(value)


def _strs(doc: dict[str, Any], key: str) -> tuple[str, ...]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ShimReportError(f"shim report: {key!r} must be a list of strings, got {value!r}")
    return tuple(value)


def _opt_int(doc: dict[str, Any], key: str) -> int | None:
    value = doc.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ShimReportError(f"shim report: {key!r} must be an integer or null, got {value!r}")
    return value


def _opt_str(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise ShimReportError(f"shim report: {key!r} must be a string or null, got {value!r}")
    return value


def parse_shim_report(data: bytes) -> ShimReport:
    """Parse everything read from the report fd up to EOF.

    Line 1 is the binding report; an optional later line carries `exec_error`
    and `errno`. A shim that failed before writing (bad arguments: exit 2)
    leaves no line: ShimReportError.
    """
    docs: list[dict[str, Any]] = []
    for number, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            doc = json.loads(raw)
        except ValueError as err:
            raise ShimReportError(f"shim report line {number}: not JSON: {err}") from None
        if not isinstance(doc, dict):
            raise ShimReportError(f"shim report line {number}: expected an object")
        docs.append(doc)
    if not docs:
        raise ShimReportError("shim report: empty (the shim exited before binding)")
    main = docs[0]
    if "exec_error" in main and "mempolicy" not in main:
        raise ShimReportError("shim report: exec error without a binding report")
    step = main.get("mempolicy")
    if step not in get_args(MemPolicyStep):
        raise ShimReportError(f"shim report: bad mempolicy {step!r}")
    exec_doc = next((d for d in docs[1:] if "exec_error" in d), {})
    pid = main.get("pid")
    uid, gid = main.get("uid"), main.get("gid")
    return ShimReport(
        cpus=_ints(main, "cpus"),
        mems=_ints(main, "mems"),
        mempolicy=cast(MemPolicyStep, step),
        reason=_opt_str(main, "reason"),
        cgroups=_strs(main, "cgroups"),
        cgroup_errors=_strs(main, "cgroup_errors"),
        affinity_error=_opt_str(main, "affinity_error"),
        cgroup_errnos=_ints(main, "cgroup_errnos"),
        affinity_errno=_opt_int(main, "affinity_errno"),
        mempolicy_errno=_opt_int(main, "mempolicy_errno"),
        pid=pid if isinstance(pid, int) else None,
        exec_error=_opt_str(exec_doc, "exec_error"),
        errno=_opt_str(exec_doc, "errno"),
        uid=uid if isinstance(uid, int) else None,
        gid=gid if isinstance(gid, int) else None,
        user_error=_opt_str(main, "user_error"),
    )


def _idlist(ids: Iterable[int]) -> str:
    return ",".join(str(i) for i in sorted(set(ids)))


def shim_argv(
    python: str,
    cpus: Iterable[int],
    mems: Iterable[int],
    argv: Sequence[str],
    *,
    cgroups: Sequence[str] = (),
    report_fd: int | None = None,
    parent_pid: int | None = None,
    mempolicy: str = "bind",
    pdeathsig: str = "TERM",
    name: str | None = None,
    isolated: bool = True,
    user: tuple[int, int, Sequence[int]] | None = None,
) -> list[str]:
    """The argv that runs `argv` through the shim with `python`.

    `isolated=True` runs the shim as `python -I -S -c SHIM_STUB`: no
    site-packages (whose .pth import hooks cost ~10 ms), no PYTHON* variables,
    about half the start-up cost of `python -m supervisor.run.shim` (see
    tests/bench/shim_bench.py). The worker's own environment is untouched.
    `report_fd` must reach the child (pass it in `pass_fds`); `parent_pid` is
    normally os.getpid() of the spawner.
    `pdeathsig` "" or "none" sets no parent-death signal.
    `user` (uid, gid, supplementary gids): the shim drops to it after binding.
    """
    if not argv:
        raise ValueError("shim_argv: empty command")
    if mempolicy not in get_args(MemPolicyStep):
        raise ValueError(
            f"shim_argv: mempolicy must be bind, local, preferred or none, got {mempolicy!r}"
        )
    cmd = (
        [python, "-I", "-S", "-c", SHIM_STUB] if isolated else [python, "-m", "supervisor.run.shim"]
    )
    cpu_text = _idlist(cpus)
    if cpu_text:
        cmd += ["--cpus", cpu_text]
    cmd += ["--mems", _idlist(mems), "--mempolicy", mempolicy]
    for directory in cgroups:
        cmd += ["--cgroup", directory]
    if pdeathsig and pdeathsig.lower() != "none":
        if pdeathsig.upper().removeprefix("SIG") not in PDEATHSIGS:
            raise ValueError(f"shim_argv: pdeathsig must be one of {PDEATHSIGS}, got {pdeathsig!r}")
        cmd += ["--pdeathsig", pdeathsig.upper().removeprefix("SIG")]
    if parent_pid is not None:
        cmd += ["--parent-pid", str(parent_pid)]
    if report_fd is not None:
        cmd += ["--report-fd", str(report_fd)]
    if name:
        cmd += ["--name", name]
    if user is not None:
        uid, gid, groups = user
        cmd += ["--uid", str(uid), "--gid", str(gid), "--groups", _idlist(groups)]
    cmd.append("--")
    cmd.extend(argv)
    return cmd


# -- the report against the plan (pure) ---------------------------------------------


def bound_as_planned(
    report: ShimReport,
    slot: Slot,
    *,
    mempolicy_allowed: bool = True,
    wanted: MemPolicyStep = "bind",
) -> bool:
    """True when the kernel read back exactly the planned CPUs and the `wanted`
    policy (MPOL_BIND to the mems, or MPOL_LOCAL); with `mempolicy_allowed`
    False (the host denies a memory policy, probed at start:
    supervisor.bind.capability) the CPUs alone: bound as far as allowed."""
    if wanted == "bind":
        memory = report.mempolicy == "bind" and tuple(report.mems) == tuple(sorted(slot.mems))
    else:
        memory = report.mempolicy == wanted
    return (
        cpus_as_planned(report, slot)
        and (memory or not mempolicy_allowed)
        and not report.cgroup_errors
    )


def cpus_as_planned(report: ShimReport, slot: Slot) -> bool:
    """The kernel read back exactly the planned CPUs."""
    return report.affinity_error is None and tuple(report.cpus) == tuple(sorted(slot.cpus))
