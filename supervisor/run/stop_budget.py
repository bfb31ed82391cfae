"""How long each stage of the daemon's stop may wait (pure, plus one start-up log line).

A container runtime sends TERM, then KILL once its grace period is over
(`docker stop`: 10 s unless `--stop-timeout`/`-t`; Kubernetes:
terminationGracePeriodSeconds, 30 s). The daemon stops the workers (TERM,
KILL after stop_timeout_s), then the engine (the same), then ends what is
left of each tree and cleans up, so a stop can take 2 * stop_timeout_s and
more. With `stop_grace_s` set, every wait is cut to fit: the workers' ends
(with an engine) half of what the grace leaves after STOP_MARGIN_S, the
engine's and the trees' at the whole of it.
"""

from __future__ import annotations

import logging

from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey

log = logging.getLogger("placement_supervisor.daemon")

# Left after the last wait: the KILLed reaped, cgroups removed, IRQs restored, the API closed.
STOP_MARGIN_S = 2.0


def worst_stop_s(timeout_s: float, has_engine: bool) -> float:
    """The longest uncapped stop: a TERM-to-KILL wait per stage, plus the margin."""
    return (2 if has_engine else 1) * timeout_s + STOP_MARGIN_S


def stage_until_s(grace_s: float, key: ProcKey, has_engine: bool) -> float:
    """Seconds after the stop began by which `key`'s end must be done."""
    usable_s = max(0.0, grace_s - STOP_MARGIN_S)
    return usable_s / 2 if has_engine and key != "engine" else usable_s


def stop_wait_s(
    timeout_s: float,
    grace_s: float | None,
    started_at: float | None,
    key: ProcKey,
    *,
    has_engine: bool,
    now: float,
) -> float:
    """How long to wait for `key` to exit after its TERM, before the KILL.

    `timeout_s` (stop_timeout_s) outside a stop (`started_at` None, e.g. a
    restart) or without a grace; within one, never past the stage's deadline."""
    if grace_s is None or started_at is None:
        return timeout_s
    left_s = started_at + stage_until_s(grace_s, key, has_engine) - now
    return max(0.0, min(timeout_s, left_s))


def log_stop_budget(
    timeout_s: float, grace_s: float | None, *, has_engine: bool, pid: int
) -> str | None:
    """At start: a warning when the uncapped stop would outlast the grace (the waits
    are then cut), or, as a container's PID 1 without one, a hint. Returns it."""
    worst = worst_stop_s(timeout_s, has_engine)
    fields = {"stop_timeout_s": f"{timeout_s:g}", "worst_s": f"{worst:g}"}
    if grace_s is not None and worst > grace_s:
        message = "stop budget " + format_fields(
            **fields, stop_grace_s=f"{grace_s:g}", action="cap each wait to fit the grace"
        )
        log.warning(message)
        return message
    if grace_s is None and pid == 1:
        message = "stop budget " + format_fields(
            **fields,
            stop_grace_s="unset",
            hint="set stop_grace_s to the runtime's grace (docker 10 s, Kubernetes 30 s)",
        )
        log.info(message)
        return message
    return None
