"""The restart policy: backoff, cap, stable reset, crash loop, per policy (pure)."""

from __future__ import annotations

import errno

from hypothesis import given
from hypothesis import strategies as st

from supervisor.config import RestartConfig
from supervisor.run.restart import (
    RestartHistory,
    RunOutcome,
    backoff_s,
    decide_restart,
    is_fd_shortage,
    record_outcome,
)

CFG = RestartConfig(
    policy="on-failure",
    backoff_initial_s=1.0,
    backoff_max_s=10.0,
    backoff_factor=2.0,
    crash_loop_limit=4,
    crash_loop_window_s=60.0,
    stable_after_s=30.0,
)


def crash(at: float, ran_s: float = 0.5, code: int | None = 1) -> RunOutcome:
    return RunOutcome(exit_code=code, ran_s=ran_s, ended_at=at)


def test_backoff_grows_by_factor_and_caps() -> None:
    assert [backoff_s(CFG, n) for n in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_backoff_never_overflows_on_a_huge_attempt() -> None:
    assert backoff_s(CFG, 10_000) == 10.0


@given(
    initial=st.floats(0.0, 100.0),
    extra=st.floats(0.0, 1000.0),
    factor=st.floats(1.0, 10.0),
    attempt=st.integers(0, 200),
)
def test_backoff_is_monotonic_and_within_bounds(
    initial: float, extra: float, factor: float, attempt: int
) -> None:
    cfg = RestartConfig(
        backoff_initial_s=initial, backoff_max_s=initial + extra, backoff_factor=factor
    )
    now = backoff_s(cfg, attempt)
    assert min(initial, cfg.backoff_max_s) <= now <= cfg.backoff_max_s
    assert backoff_s(cfg, attempt + 1) >= now


def test_consecutive_crashes_back_off_exponentially() -> None:
    history = RestartHistory()
    delays = []
    for i in range(3):
        decision = decide_restart(CFG, history, crash(at=float(i)))
        assert decision.action == "restart"
        delays.append(decision.delay_s)
        history = decision.history
    assert delays == [1.0, 2.0, 4.0]


def test_a_stable_run_resets_the_backoff() -> None:
    history = RestartHistory(attempt=3, failures=(0.0,))
    decision = decide_restart(CFG, history, crash(at=100.0, ran_s=31.0))
    assert decision.action == "restart"
    assert decision.delay_s == 1.0
    assert decision.history.attempt == 1


def test_crash_loop_limit_within_window_fails() -> None:
    history = RestartHistory()
    actions = []
    for i in range(4):
        decision = decide_restart(CFG, history, crash(at=float(i)))
        actions.append(decision.action)
        history = decision.history
    assert actions == ["restart", "restart", "restart", "fail"]
    assert "crash loop" in decision.reason


def test_failures_outside_the_window_are_forgotten() -> None:
    history = RestartHistory()
    for at in (0.0, 1.0, 2.0, 100.0):  # the last comes 98 s after the third
        decision = decide_restart(CFG, history, crash(at=at))
        history = decision.history
    assert decision.action == "restart"
    assert history.failures == (100.0,)


def test_could_not_start_counts_as_a_failure() -> None:
    decision = decide_restart(CFG, RestartHistory(), crash(at=0.0, ran_s=0.0, code=None))
    assert decision.action == "restart"
    assert decision.reason.startswith("could not start")
    assert decision.history.failures == (0.0,)


def test_on_failure_stops_after_a_clean_exit() -> None:
    decision = decide_restart(CFG, RestartHistory(), crash(at=0.0, code=0))
    assert decision.action == "stop"


def test_always_restarts_a_clean_exit_after_a_stable_run_without_counting_it() -> None:
    cfg = RestartConfig(policy="always", crash_loop_limit=1, stable_after_s=30.0)
    decision = decide_restart(cfg, RestartHistory(), crash(at=100.0, ran_s=31.0, code=0))
    assert decision.action == "restart"
    assert decision.history.failures == ()


def test_always_with_quick_clean_exits_reaches_the_crash_loop_limit() -> None:
    cfg = RestartConfig(policy="always", crash_loop_limit=3, stable_after_s=30.0)
    history = RestartHistory()
    actions = []
    for i in range(3):
        decision = decide_restart(cfg, history, crash(at=float(i), ran_s=0.01, code=0))
        actions.append(decision.action)
        history = decision.history
    assert actions == ["restart", "restart", "fail"]
    assert "crash loop" in decision.reason and "runs under 30s" in decision.reason


def test_a_readiness_timeout_is_a_failed_start_whatever_the_exit_code() -> None:
    not_ready = RunOutcome(exit_code=0, ran_s=120.0, ended_at=0.0, not_ready=True)
    assert not_ready.failed
    decision = decide_restart(CFG, RestartHistory(), not_ready)
    assert decision.action == "restart"  # on-failure: a failure, not a clean stop
    assert decision.reason.startswith("not ready in time")
    assert decision.history.failures == (0.0,)
    never = RestartConfig(policy="never")
    assert decide_restart(never, RestartHistory(), not_ready).action == "fail"


def test_never_fails_a_crash_and_stops_a_clean_exit() -> None:
    cfg = RestartConfig(policy="never")
    assert decide_restart(cfg, RestartHistory(), crash(at=0.0, code=-9)).action == "fail"
    assert decide_restart(cfg, RestartHistory(), crash(at=0.0, code=0)).action == "stop"


def test_signal_deaths_are_named() -> None:
    decision = decide_restart(CFG, RestartHistory(), crash(at=0.0, code=-9))
    assert "SIGKILL" in decision.reason


def test_record_outcome_keeps_attempt_for_short_runs() -> None:
    history = record_outcome(CFG, RestartHistory(attempt=2), crash(at=5.0, ran_s=1.0))
    assert history.attempt == 2


def test_a_start_without_file_descriptors_backs_off_and_never_fails_the_rank() -> None:
    assert is_fd_shortage(OSError(errno.EMFILE, "Too many open files"))
    assert is_fd_shortage(OSError(errno.ENFILE, "Too many open files in system"))
    assert not is_fd_shortage(OSError(errno.ENOENT, "No such file"))
    assert not is_fd_shortage(ValueError("x"))
    for policy in ("on-failure", "never", "always"):
        cfg = RestartConfig(
            policy=policy,  # type: ignore[arg-type]
            backoff_initial_s=1.0,
            backoff_max_s=10.0,
            crash_loop_limit=2,
            crash_loop_window_s=60.0,
        )
        history = RestartHistory()
        delays = []
        for i in range(20):  # far past crash_loop_limit, inside the window
            d = decide_restart(cfg, history, RunOutcome(None, 0.0, float(i), no_fds=True))
            assert d.action == "restart", (policy, i, d.reason)
            assert "file descriptors" in d.reason
            history = d.history
            delays.append(d.delay_s)
        assert history.failures == ()  # no crash counted
        assert delays[:5] == [1.0, 2.0, 4.0, 8.0, 10.0]  # the normal backoff
    # A real crash after them still counts toward the loop as before.
    d = decide_restart(CFG, history, crash(30.0))
    assert d.action == "restart" and len(d.history.failures) == 1
