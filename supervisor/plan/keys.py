"""The names of what is placed: supervised processes (`ProcKey`) and thread roles (pure).

A `ProcKey` is a rank number or "engine"; a `ThreadRole` puts threads of the
engine's or the workers' trees (`ProcessKind`) on their role's CPUs. The
config builds roles, the plan sizes them, the check loop matches threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ProcKey = int | Literal["engine"]
"""A rank number, or "engine"."""

ProcessKind = Literal["engine", "workers"]
"""Which supervised process (and its tree) a thread role applies to."""


def key_label(key: ProcKey) -> str:
    """The `rank` label of metrics and events: the rank number, or "engine"."""
    return str(key)


@dataclass(frozen=True, slots=True)
class ThreadRole:
    """Threads of `process` whose OS name (comm) matches `pattern` get `role`'s CPUs."""

    role: str
    process: ProcessKind
    pattern: str  # fnmatch glob over /proc/<pid>/task/<tid>/comm (15 chars)
    # Module-name prefixes: a ThreadPoolExecutor created in one of them is
    # renamed `<role>-N`, sized and bound by the start-up hook (supervisor.hook).
    executors: tuple[str, ...] = ()
