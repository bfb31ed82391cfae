"""Early rank binding for the start-up hook (stdlib only; imported by sitecustomize.py).

A process below the engine that a rule of `PLACEMENT_SUPERVISOR_EARLY_RANK`
(supervisor.engines.early) names puts itself on its rank's CPUs and MPOL_BIND to
its rank's nodes: at start-up for an env rank, just before the target runs for
a multiprocessing call rule. Only the process itself can set its memory policy
(set_mempolicy(2) acts on the calling thread, and threads and children started
later inherit it). Imported only where the engine's tree carries the rules.
"""

# ruff: noqa: PLC0415

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import ModuleType
    from typing import Any

RANK_SLOTS_ENV = "PLACEMENT_SUPERVISOR_RANK_SLOTS"  # as in sitecustomize.py
EARLY_TARGET = "multiprocessing.process"  # BaseProcess._bootstrap runs a child's target
MARK = "_placement_supervisor_early"
MPOL_BIND = 2  # <linux/mempolicy.h>
# set_mempolicy(2) by machine (arch/x86/entry/syscalls/syscall_64.tbl,
# include/uapi/asm-generic/unistd.h); elsewhere the CPUs alone are set early.
SET_MEMPOLICY_NR = {"x86_64": 238, "aarch64": 237}

bound_rank: int | None = None  # the rank this process bound itself to (sitecustomize.slot_doc)
_warn: Callable[..., None] | None = None


def warn(event: str, action: str, **fields: object) -> None:
    if _warn is not None:
        _warn(event, action, **fields)
    else:  # pragma: no cover - install_early always sets it
        sys.stderr.write(f"placement-supervisor hook: {event} action={action}\n")


def parse_early(text: str) -> tuple[dict[int, int], list[str], dict[str, tuple[str, int]]]:
    """`local=L:R,..;env=NAME;call=QUALNAME:KWARG:INDEX` (supervisor.engines.early)
    -> ({local rank: rank}, env names, {qualname: (kwarg, index)}). ValueError if bad."""
    local: dict[int, int] = {}
    envs: list[str] = []
    calls: dict[str, tuple[str, int]] = {}
    for part in text.split(";"):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"bad part {part!r}")
        if name == "local":
            for pair in value.split(","):
                if pair:
                    lr, _, r = pair.partition(":")
                    local[int(lr)] = int(r)
        elif name == "env":
            envs.append(value)
        elif name == "call":
            qualname, kwarg, index = value.rsplit(":", 2)
            calls[qualname] = (kwarg, int(index))
    return local, envs, calls


def _local(value: object, local: dict[int, int]) -> int | None:
    text = str(value).strip()
    return local.get(int(text)) if text.isdigit() else None


def install_early(
    text: str,
    patch_on_import: Callable[[str, Callable[[ModuleType], None]], None],
    warn_once: Callable[..., None],
) -> None:
    """Bind now for an env rule; patch multiprocessing for a call rule."""
    global _warn
    _warn = warn_once
    local, envs, calls = parse_early(text)
    for name in envs:
        rank = _local(os.environ.get(name, ""), local)
        if rank is not None:
            bind_early(rank, f"env:{name}")
            return
    if calls:
        patch_on_import(EARLY_TARGET, lambda module: patch_bootstrap(module, local, calls))


def patch_bootstrap(
    module: ModuleType, local: dict[int, int], calls: dict[str, tuple[str, int]]
) -> None:
    """Wrap BaseProcess._bootstrap: in a multiprocessing child (spawn or fork),
    just before its target runs, bind when the target is a listed one."""
    klass = module.BaseProcess
    original = klass._bootstrap
    if getattr(original, MARK, False):
        return

    def _bootstrap(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            qualname = getattr(getattr(self, "_target", None), "__qualname__", "")
            rule = calls.get(qualname)
            if rule is not None and bound_rank is None:
                kwarg, index = rule
                found = self._kwargs.get(kwarg)
                if found is None and 0 <= index < len(self._args):
                    found = self._args[index]
                rank = None if found is None else _local(found, local)
                if rank is not None:
                    bind_early(rank, f"call:{qualname}")
        except Exception as err:
            warn("early bind", "unhooked", error=repr(err))
        return original(self, *args, **kwargs)

    setattr(_bootstrap, MARK, True)
    klass._bootstrap = _bootstrap


def bind_early(rank: int, rule: str) -> None:
    """This process (its one thread, so far) onto rank `rank`'s CPUs and nodes.

    Each failure is one line and the process runs on: the daemon's adoption
    binds the CPUs again, and where the host denies a memory policy (seccomp)
    the CPUs alone place its pages (the engine's MPOL_LOCAL is inherited).
    """
    global bound_rank
    import json

    docs = json.loads(os.environ.get(RANK_SLOTS_ENV) or "{}")
    doc = docs.get(str(rank)) if isinstance(docs, dict) else None
    if not isinstance(doc, dict):
        warn("early bind", "skip", rank=rank, rule=rule, error="no slot for the rank")
        return
    bound_rank = rank
    cpus = [int(c) for c in doc.get("cpus") or ()]
    mems = [int(m) for m in doc.get("mems") or ()]
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
    except OSError as err:
        warn("early bind", "skip", rank=rank, rule=rule, cpus=cpus, error=repr(err))
    error = set_mempolicy_bind(mems) if mems else None
    if error is not None:
        warn("early bind", "cpus only", rank=rank, rule=rule, mems=mems, error=error)


def set_mempolicy_bind(mems: Sequence[int]) -> str | None:
    """MPOL_BIND to `mems` for the calling thread (and what it starts); None, or why not."""
    number = SET_MEMPOLICY_NR.get(os.uname().machine)
    if number is None:
        return f"no set_mempolicy number for {os.uname().machine}"
    import ctypes

    words = max(mems) // 64 + 1
    bits = 0
    for node in mems:
        bits |= 1 << node
    mask = (ctypes.c_ulong * words)(*((bits >> (64 * i)) & (2**64 - 1) for i in range(words)))
    libc = ctypes.CDLL(None, use_errno=True)
    # maxnode is bits + 1: the kernel reads maxnode - 1 bits (mm/mempolicy.c get_nodes).
    done = libc.syscall(
        ctypes.c_long(number), ctypes.c_int(MPOL_BIND), mask, ctypes.c_ulong(words * 64 + 1)
    )
    if done != 0:
        return os.strerror(ctypes.get_errno())
    return None
