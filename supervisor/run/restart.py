"""Restart policy: what to do when a supervised process exits (pure, no I/O).

`decide_restart` takes the policy of the config, the process's restart history
and how its last run ended, and answers restart (after a backoff), stop, or
fail (a crash loop). Times are seconds on one monotonic clock chosen by the
caller, so the function is deterministic and tested without sleeping.
"""

from __future__ import annotations

import errno
import signal
from dataclasses import dataclass, replace
from typing import Literal

from supervisor.config import RestartConfig

RestartAction = Literal["restart", "stop", "fail"]
# The process (EMFILE) or the host (ENFILE) is out of file descriptors (open(2)).
FD_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE})


def is_fd_shortage(err: BaseException) -> bool:
    """An OSError that says "no file descriptor left", not "this command is broken"."""
    return isinstance(err, OSError) and err.errno in FD_SHORTAGE


@dataclass(frozen=True, slots=True)
class RestartHistory:
    """What the policy remembers about one process between its runs."""

    attempt: int = 0  # restarts since the last stable run: the backoff exponent
    failures: tuple[float, ...] = ()  # monotonic times of failed starts inside the window


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How one run ended.

    `exit_code` is the wait status as subprocess reports it (negative: killed
    by that signal), None when the process could not be started at all (the
    command is missing, the shim could not exec it).
    """

    exit_code: int | None
    ran_s: float  # from spawn to exit
    ended_at: float  # monotonic
    not_ready: bool = False  # the readiness probe gave up and the process was stopped
    # The start failed for want of file descriptors (EMFILE/ENFILE): the host's
    # fault, not the process's. Retried with the backoff whatever the policy,
    # and never counted toward the crash loop.
    no_fds: bool = False

    @property
    def failed(self) -> bool:
        # A probe that timed out is a failed start whatever the stopped
        # process exited with (an engine stopped by TERM may well exit 0).
        return self.exit_code != 0 or self.not_ready


@dataclass(frozen=True, slots=True)
class RestartDecision:
    action: RestartAction
    delay_s: float  # the backoff before the next start (restart only)
    history: RestartHistory
    reason: str  # one phrase for the log line and the event


def backoff_s(config: RestartConfig, attempt: int) -> float:
    """backoff_initial_s * backoff_factor**attempt, capped at backoff_max_s."""
    if attempt <= 0:
        return min(config.backoff_initial_s, config.backoff_max_s)
    # Cap the exponent before raising: factor**attempt overflows a float long
    # before a real crash loop gets there, and the cap makes the rest moot.
    delay = config.backoff_initial_s
    for _ in range(attempt):
        delay *= config.backoff_factor
        if delay >= config.backoff_max_s:
            return config.backoff_max_s
    return min(delay, config.backoff_max_s)


def record_outcome(
    config: RestartConfig, history: RestartHistory, outcome: RunOutcome
) -> RestartHistory:
    """The history after a run: a stable run resets the backoff, a failure is counted."""
    stable = outcome.ran_s >= config.stable_after_s
    attempt = 0 if stable else history.attempt
    window_start = outcome.ended_at - config.crash_loop_window_s
    failures = tuple(t for t in history.failures if t > window_start)
    # Under `always` a clean exit restarts too, so one that comes before the
    # run is stable counts toward the crash loop: else `exit 0` at once would
    # be restarted for ever (systemd's start limit counts every start alike).
    if outcome.no_fds:
        pass  # nothing ran: no crash to count
    elif outcome.failed or (config.policy == "always" and not stable):
        failures = (*failures, outcome.ended_at)
    return RestartHistory(attempt=attempt, failures=failures)


def decide_restart(
    config: RestartConfig, history: RestartHistory, outcome: RunOutcome
) -> RestartDecision:
    """Restart with backoff, stop, or fail, per `config.policy` and the crash-loop limit.

    - never: stop after a clean exit, fail after a failed one;
    - on-failure: stop after a clean exit, else restart;
    - always: restart after any exit.
    A start that failed for want of file descriptors is retried after the
    backoff under every policy and never counts toward the crash loop (the
    descriptors come back; a held-down rank would not). A readiness timeout
    is a failed start. A restart that would make
    `crash_loop_limit` failed starts (under `always`, clean exits before
    `stable_after_s` too) within `crash_loop_window_s` turns into fail: the
    process stays down (others keep running) until someone restarts it by hand.
    """
    updated = record_outcome(config, history, outcome)
    how = _describe(outcome.exit_code)
    if outcome.not_ready:
        how = f"not ready in time (stopped, {how})"
    if outcome.no_fds:
        delay = backoff_s(config, updated.attempt)
        return RestartDecision(
            "restart",
            delay,
            replace(updated, attempt=updated.attempt + 1),
            "could not start: out of file descriptors (EMFILE/ENFILE)",
        )
    if config.policy == "never" or (config.policy == "on-failure" and not outcome.failed):
        action: RestartAction = "fail" if outcome.failed else "stop"
        return RestartDecision(action, 0.0, updated, f"{how}, policy={config.policy}")
    if len(updated.failures) >= config.crash_loop_limit:
        short = f" or runs under {config.stable_after_s:g}s" if config.policy == "always" else ""
        return RestartDecision(
            "fail",
            0.0,
            updated,
            f"{how}; crash loop: {len(updated.failures)} failed starts{short}"
            f" within {config.crash_loop_window_s:g}s",
        )
    delay = backoff_s(config, updated.attempt)
    return RestartDecision(
        "restart",
        delay,
        replace(updated, attempt=updated.attempt + 1),
        f"{how}, policy={config.policy}",
    )


def _describe(exit_code: int | None) -> str:
    if exit_code is None:
        return "could not start"
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = str(-exit_code)
        return f"killed by {name}"
    return f"exited with status {exit_code}"
