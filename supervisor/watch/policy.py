"""The check loop's policy for one pass: what `[drift]` says and why the pass runs (pure).

`Policy.action` resolves a drift kind's configured action ("observe",
"enforce", or memory_locality's "auto") for one process in one pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from supervisor.config import DriftConfig, DriftPolicy
from supervisor.state import DriftKind

Cause = Literal["check", "api", "cpuset_changed"]
"""Why a pass runs: the periodic check, POST /rebind, or a new plan after a cpuset change."""
Action = Literal["observe", "enforce"]  # a drift policy resolved for one process and pass

ENFORCED_KINDS: tuple[DriftKind, ...] = (
    "thread_affinity",
    "memory_locality",
    "irq_affinity",
    "self_rebind",
    "cgroup",
)
# Findings about one thread's CPUs: a thread off its role, or a process that
# bound all of itself outside its slot (vLLM --numa-bind, SGLang's numactl).
THREAD_KINDS: tuple[DriftKind, ...] = ("thread_affinity", "self_rebind")


@dataclass(frozen=True, slots=True)
class Policy:
    """What `[drift]` says, and why this pass runs."""

    actions: Mapping[str, DriftPolicy]  # [drift.policy]
    threshold: float = 0.9
    enforce_pinned: bool = False
    migrate_max_bytes_per_s: int = 1 << 30
    check_interval_s: float = 1.0
    cause: Cause = "check"
    # cause "cpuset_changed": the slot's nodes changed and no cgroup moves the
    # pages, so every page off the new nodes moves (from any of `node_ids`).
    move_memory: bool = False
    node_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, drift: DriftConfig, cause: Cause = "check", **more: Any) -> Policy:
        return cls(
            MappingProxyType(dict(drift.policy)),
            drift.local_memory_threshold,
            drift.enforce_pinned,
            drift.migrate_max_bytes_per_s,
            drift.check_interval_s,
            cause,
            **more,
        )

    def action(self, kind: str, bound_from_birth: bool) -> Action:
        """ "enforce" or "observe" for a finding of `kind` in a pass of this cause.

        "auto" (memory_locality's default) enforces for a process that was not
        bound to its nodes from birth (an adopted worker, an engine's child:
        its policy is not ours to set, so its remote pages are moved) and
        observes one that was (nothing of its own can land off its nodes)."""
        if self.cause == "api":
            return "enforce" if kind in ENFORCED_KINDS else "observe"
        if self.cause == "cpuset_changed":
            return "enforce" if kind in THREAD_KINDS else "observe"
        action = self.actions.get(kind, "observe")
        if action == "auto":
            return "observe" if bound_from_birth else "enforce"
        return action

    @property
    def force(self) -> bool:
        return self.cause == "api"
