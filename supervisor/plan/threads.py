"""Thread roles: which role each thread of a supervised process has (pure, no I/O).

A supervised process's threads are matched to roles by their OS name (comm,
at most 15 bytes) with the config's `[threads.*]` globs; each thread belongs on
its role's CPUs (`Slot.role_cpus`). `thread_verdict` says whether it is: a
thread the workload pinned itself to a strict subset of its role's CPUs is
respected unless `enforce_pinned` says otherwise (vllm-ascend's binder
re-bound such threads and undid the workload's own placement). The re-binds
themselves are decided in one place, supervisor.watch.decide.

Which roles apply where (docs/contracts.md §7, `process` covers the named process and
its whole tree): `role_kinds` chooses the kinds per supervised process, and
`with_engine_roles` gives an adopted worker's tree the engine's role CPUs
where its cpuset lets it use them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Literal

from supervisor.plan.keys import ProcessKind, ThreadRole
from supervisor.plan.placement import Slot
from supervisor.procfs.identity import ThreadId

ThreadVerdict = Literal["ok", "pinned", "drift"]
DEFAULT_ROLE = "main"
COMM_MAX_CHARS = 15  # TASK_COMM_LEN - 1 (prctl(2) PR_SET_NAME)

# Thread roles the supervisor knows without a config: the names
# `supervisor.worker.pool_initializer` gives ("so-compile-<n>" when the
# engine passes that prefix, "so-compiler-<n>" by default).
DEFAULT_THREAD_ROLES: tuple[ThreadRole, ...] = (ThreadRole("so_compiler", "engine", "so-compile*"),)


@dataclass(frozen=True, slots=True)
class LiveThread:
    """One thread as read from the host: tid, comm, allowed CPUs (sorted), and its
    start time (stat field 22) where it was read: what tells a reused tid apart."""

    tid: int
    name: str
    cpus: tuple[int, ...]
    id: ThreadId | None = field(default=None, compare=False)  # who, not what it is


def role_for_thread(name: str, process: ProcessKind, roles: Sequence[ThreadRole]) -> str:
    """The role of the first `roles` entry for `process` whose glob matches `name`.

    Matching is case-sensitive (comm is bytes) over the first 15 characters,
    the whole of what the kernel keeps; no match means "main".
    """
    comm = name[:COMM_MAX_CHARS]
    for role in roles:
        if role.process == process and fnmatchcase(comm, role.pattern):
            return role.role
    return DEFAULT_ROLE


def role_kinds(key: object, adopted: bool) -> tuple[ProcessKind, ...]:
    """The `process` kinds whose roles apply to a supervised process and its tree.

    The engine's tree: "engine". A worker the supervisor spawned: "workers".
    An adopted worker is a rank's and also of the engine's tree (SGLang
    compiles grammars in each scheduler): "workers" and "engine".
    """
    if key == "engine":
        return ("engine",)
    return ("workers", "engine") if adopted else ("workers",)


def with_engine_roles(
    slot: Slot,
    engine: Slot | None,
    roles: Sequence[ThreadRole],
    cpuset: Collection[int],
) -> Slot:
    """An adopted worker's slot with the CPUs of the engine's roles its threads may carry.

    A `process = "engine"` role named in a worker (the hook's `so_compiler-N`
    in an SGLang scheduler) belongs on the engine slot's CPUs for that role
    only where those lie inside the worker's `cpuset` (its rank cgroup's
    CPUs, or the supervisor's allowed CPUs when it has no cgroup of its own),
    as the hook decides (`bind_target`); otherwise the rank's slot answers,
    which is the worker's `main` unless the rank plans that role itself. A
    name that a `process = "workers"` role also uses keeps the rank's meaning.
    """
    if engine is None:
        return slot
    rank_names = {r.role for r in roles if r.process == "workers"}
    allowed = set(cpuset)
    extra: dict[str, tuple[int, ...]] = {}
    for name in _names(r.role for r in roles if r.process == "engine"):
        if name in slot.roles or name in rank_names:
            continue
        want = engine.role_cpus(name)
        if want and set(want) <= allowed:
            extra[name] = want
    return replace(slot, roles={**slot.roles, **extra}) if extra else slot


def _names(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


class RoleMatcher:
    """`role_for_thread` for one or more process kinds, memoised by name.

    With several kinds (an adopted worker: "workers" and "engine") the first
    role of any of them that matches wins, in the config's order. A process
    has hundreds of threads but few distinct names, so a check cycle matches
    each name once. The memo is bounded: a workload that names threads
    uniquely ("req-18231") cannot grow it without limit.
    """

    __slots__ = ("_memo", "_roles", "kinds", "process")
    MEMO_MAX = 4096

    def __init__(
        self, process: ProcessKind | tuple[ProcessKind, ...], roles: Sequence[ThreadRole]
    ) -> None:
        self.kinds: tuple[ProcessKind, ...] = (process,) if isinstance(process, str) else process
        self.process: ProcessKind = self.kinds[0]
        self._roles = tuple(r for r in roles if r.process in self.kinds)
        self._memo: dict[str, str] = {}

    def role(self, name: str) -> str:
        role = self._memo.get(name)
        if role is None:
            comm = name[:COMM_MAX_CHARS]
            role = next((r.role for r in self._roles if fnmatchcase(comm, r.pattern)), DEFAULT_ROLE)
            if len(self._memo) >= self.MEMO_MAX:
                self._memo.clear()
            self._memo[name] = role
        return role


def thread_verdict(
    live_cpus: Collection[int], role_cpus: Collection[int], enforce_pinned: bool
) -> ThreadVerdict:
    """ "ok" when the thread is on its role's CPUs, "pinned" when the workload
    narrowed it to a strict non-empty subset of them (respected unless
    `enforce_pinned`), else "drift"."""
    live = live_cpus if isinstance(live_cpus, (set, frozenset)) else frozenset(live_cpus)
    want = role_cpus if isinstance(role_cpus, (set, frozenset)) else frozenset(role_cpus)
    if live == want:
        return "ok"
    if live and live < want and not enforce_pinned:
        return "pinned"
    return "drift"


def unmatchable_patterns(roles: Sequence[ThreadRole]) -> list[str]:
    """Messages for globs that can never match a 15-character comm.

    "acl_thread_worker" (17 literal characters) never matches: the kernel
    keeps only "acl_thread_work". The config loader or daemon can warn.
    """
    messages: list[str] = []
    for role in roles:
        shortest = _shortest_match_len(role.pattern)
        if shortest > COMM_MAX_CHARS:
            messages.append(
                f"thread role {role.role!r} pattern {role.pattern!r} needs at least "
                f"{shortest} characters but thread names keep only {COMM_MAX_CHARS}; "
                f"use {role.pattern[:COMM_MAX_CHARS]!r}* or shorter"
            )
    return messages


def _shortest_match_len(pattern: str) -> int:
    """Length of the shortest string fnmatch `pattern` can match."""
    n = 0
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            i += 1
            continue
        if ch == "[":
            close = pattern.find("]", i + 2)  # "[]...]" puts "]" inside the set
            if close != -1:
                n += 1
                i = close + 1
                continue
        n += 1
        i += 1
    return n
