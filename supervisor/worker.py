"""In-process helper for supervised engines and workers (stdlib only; reads the environment).

The supervisor hands each child its slot in `PLACEMENT_SUPERVISOR_SLOT` (JSON:
``{"key": "engine" | "0", "rank": 0 | null, "cpus": [...], "mems": [...],
"roles": {"main": [...], "so_compiler": [...]}}``). This module lets the child
size and bind its own thread pools from that plan, and name their OS threads
so the supervisor can match them to roles. It imports nothing outside the
standard library, so any engine can import it; without a supervisor every
call degrades to "not supervised" and nothing is bound.

How an engine adopts it (vLLM / SGLang's structured-output path builds an
xgrammar compiler pool sized by ``os.cpu_count()``, which on a 192-CPU host
spawns 192 threads that then compete with the scheduler thread):

    from concurrent.futures import ThreadPoolExecutor
    from supervisor import worker

    pool = ThreadPoolExecutor(
        max_workers=worker.pool_size("so_compiler", default=8),
        initializer=worker.pool_initializer("so_compiler", "so-compile"),
    )

Each pool thread then names itself ``so-compile-<n>`` (visible in
/proc/<pid>/task/<tid>/comm, so the supervisor's thread roles can match it)
and binds itself to the plan's `so_compiler` CPUs with
``os.sched_setaffinity(0, ...)``: pid 0 means the *calling thread*
(sched_setaffinity(2)), which is what an initializer needs. psutil's
``Process().cpu_affinity()`` would act on the main thread instead.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SLOT_ENV = "PLACEMENT_SUPERVISOR_SLOT"
COMM_MAX_BYTES = 15  # TASK_COMM_LEN is 16 including the NUL (prctl(2), PR_SET_NAME)
_PR_SET_NAME = 15  # <linux/prctl.h>

log = logging.getLogger("placement_supervisor.worker")


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """The slot this process was given, as read from `SLOT_ENV`."""

    key: str  # "engine" or the rank number as text
    rank: int | None
    cpus: tuple[int, ...]
    mems: tuple[int, ...]
    roles: Mapping[str, tuple[int, ...]]

    def role_cpus(self, role: str) -> tuple[int, ...]:
        """The CPUs of `role`, falling back to `main`, then to all the slot's CPUs.

        Same rule as `supervisor.plan.placement.Slot.role_cpus`: a role the plan
        merged into `main` on a small host still gets CPUs.
        """
        return self.roles.get(role) or self.roles.get("main") or self.cpus


def slot_env_value(key: str | int, slot_doc: Mapping[str, Any]) -> str:
    """The value of `SLOT_ENV` for a child: `key` is "engine" or a rank number.

    `slot_doc` is `Slot.to_doc()` (cpus, mems, roles); the daemon puts the
    result in the child's environment.
    """
    key_text = str(key)
    rank = None if key_text == "engine" else int(key_text)
    doc = {
        "key": key_text,
        "rank": rank,
        "cpus": [int(c) for c in slot_doc.get("cpus", ())],
        "mems": [int(m) for m in slot_doc.get("mems", ())],
        "roles": {
            str(name): [int(c) for c in cpus] for name, cpus in slot_doc.get("roles", {}).items()
        },
    }
    return json.dumps(doc, separators=(",", ":"))


def _int_tuple(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"{field} must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def parse_slot_env(text: str) -> WorkerSlot:
    """Parse the JSON of `SLOT_ENV`; ValueError names the bad field (pure)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    key = doc.get("key")
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string, got {key!r}")
    rank = doc.get("rank")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise ValueError(f"rank must be an integer or null, got {rank!r}")
    roles_doc = doc.get("roles", {})
    if not isinstance(roles_doc, dict):
        raise ValueError(f"roles must be an object, got {roles_doc!r}")
    roles = {str(name): _int_tuple(cpus, f"roles.{name}") for name, cpus in roles_doc.items()}
    return WorkerSlot(
        key=key,
        rank=rank,
        cpus=_int_tuple(doc.get("cpus"), "cpus"),
        mems=_int_tuple(doc.get("mems", []), "mems"),
        roles=roles,
    )


_cache_lock = threading.Lock()
_cache: tuple[str, WorkerSlot | None] | None = None  # (raw value, parsed or None when bad)


def current_slot() -> WorkerSlot | None:
    """This process's slot, or None when not supervised (or the variable is bad).

    The environment is read on each call (never at import), and each distinct
    value is parsed once; a bad value logs one warning and reads as "not
    supervised", so a broken supervisor never breaks the engine.
    """
    global _cache
    raw = os.environ.get(SLOT_ENV)
    if raw is None:
        return None
    with _cache_lock:
        if _cache is not None and _cache[0] == raw:
            return _cache[1]
        try:
            slot: WorkerSlot | None = parse_slot_env(raw)
        except ValueError as err:
            log.warning("slot env invalid var=%s error=%s action=run unbound", SLOT_ENV, err)
            slot = None
        _cache = (raw, slot)
        return slot


def cpus(role: str = "main") -> list[int] | None:
    """The plan's CPUs for `role` in this process; None when not supervised."""
    slot = current_slot()
    return None if slot is None else list(slot.role_cpus(role))


def pool_size(role: str, default: int | None = None) -> int:
    """How many threads a pool of `role` should have: one per planned CPU.

    Never `os.cpu_count()` (the whole host). Without a supervisor: `default`,
    else the number of CPUs this thread may run on.
    """
    planned = cpus(role)
    if planned:
        return len(planned)
    if default is not None:
        return default
    return len(os.sched_getaffinity(0))


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The running process's own symbols (libc is loaded): find_library
        # would run `ldconfig -p` in a subprocess inside the engine at import.
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    prctl: Callable[..., int] = libc.prctl
    return prctl


_prctl = _load_prctl()


def set_thread_name(name: str) -> None:
    """Name the calling OS thread (its comm), truncated to 15 bytes.

    Python before 3.14 does not pass `threading.Thread.name` to the OS, so
    /proc/<pid>/task/<tid>/comm shows the process name for every thread;
    PR_SET_NAME (prctl(2)) sets it for the calling thread only. A failure is
    logged, never raised.
    """
    if _prctl is None:
        return
    raw = name.encode("utf-8", "replace")[:COMM_MAX_BYTES]
    if _prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        log.warning("thread name failed name=%s errno=%d action=skip", name, err)


def bind_current_thread(role: str) -> list[int] | None:
    """Bind the calling thread to `role`'s CPUs; returns them, or None when unbound.

    sched_setaffinity(2) with pid 0 acts on the calling thread only. A refusal
    (CPUs outside a changed cpuset: EINVAL) is logged and the thread keeps its
    affinity: a failed bind never stops the engine.
    """
    planned = cpus(role)
    if not planned:
        return None
    try:
        os.sched_setaffinity(0, planned)
    except OSError as err:
        log.warning(
            "bind failed tid=%d role=%s cpus=%s errno=%s action=skip",
            threading.get_native_id(),
            role,
            _format(planned),
            err.errno,
        )
        return None
    return planned


def pool_initializer(role: str, name_prefix: str | None = None) -> Callable[[], None]:
    """An initializer for `ThreadPoolExecutor` that names and binds each pool thread.

    Thread n (counted per returned initializer, from 0) is named
    `<name_prefix>-<n>` (default prefix: the role with "_" as "-") and bound
    to the role's planned CPUs. Without a supervisor it only names threads.
    """
    prefix = name_prefix if name_prefix is not None else role.replace("_", "-")
    counter = itertools.count()
    lock = threading.Lock()

    def initialize() -> None:
        with lock:
            n = next(counter)
        set_thread_name(f"{prefix}-{n}")
        bind_current_thread(role)

    return initialize


def _format(cpu_list: Iterable[int]) -> str:
    return ",".join(str(c) for c in cpu_list)
