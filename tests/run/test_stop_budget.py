"""The stop's waits within the runtime's grace (supervisor.run.stop_budget, pure)."""

from __future__ import annotations

import logging

import pytest

from supervisor.plan.keys import ProcKey
from supervisor.run.stop_budget import STOP_MARGIN_S, log_stop_budget, stop_wait_s, worst_stop_s


@pytest.mark.parametrize(
    "case",
    [
        (None, 100.0, 0, True, 100.0, 8.0),  # no grace: stop_timeout_s
        (10.0, None, 0, True, 100.0, 8.0),  # not stopping (a restart): stop_timeout_s
        (10.0, 100.0, 0, True, 100.0, 4.0),  # workers: half of grace - margin
        (10.0, 100.0, "engine", True, 100.0, 8.0),  # the engine: all of it, at most 8
        (10.0, 100.0, "engine", True, 104.5, 3.5),  # after the workers took 4.5 s
        (10.0, 100.0, 0, False, 100.0, 8.0),  # no engine: the workers get all of it
        (10.0, 100.0, "engine", True, 109.0, 0.0),  # past the deadline: KILL at once
        (30.0, 100.0, 0, True, 100.0, 8.0),  # Kubernetes' 30 s: nothing cut
        (1.0, 100.0, "engine", True, 100.0, 0.0),  # a grace below the margin
    ],
)
def test_stop_wait_fits_the_grace(
    case: tuple[float | None, float | None, ProcKey, bool, float, float],
) -> None:
    # (stop_grace_s, stop began at, key, has an engine, now, the wait wanted)
    grace_s, started_at, key, has_engine, now, want_s = case
    got = stop_wait_s(8.0, grace_s, started_at, key, has_engine=has_engine, now=now)
    assert got == pytest.approx(want_s)


@pytest.mark.parametrize("timeout_s", [0.5, 3.0, 8.0, 10.0, 60.0])
@pytest.mark.parametrize("grace_s", [3.0, 10.0, 30.0])
def test_workers_then_engine_never_outlast_the_grace(timeout_s: float, grace_s: float) -> None:
    # Every process uses its whole wait (it ignores TERM): the worst stop.
    t = 0.0
    t += stop_wait_s(timeout_s, grace_s, 0.0, 0, has_engine=True, now=t)
    t += stop_wait_s(timeout_s, grace_s, 0.0, "engine", has_engine=True, now=t)
    t += stop_wait_s(timeout_s, grace_s, 0.0, "engine", has_engine=True, now=t)  # the trees
    assert t <= max(0.0, grace_s - STOP_MARGIN_S) + 1e-9


def test_worst_stop_is_a_wait_per_stage_and_the_margin() -> None:
    assert worst_stop_s(10.0, has_engine=True) == 20.0 + STOP_MARGIN_S
    assert worst_stop_s(10.0, has_engine=False) == 10.0 + STOP_MARGIN_S


def test_start_warns_when_the_uncapped_stop_outlasts_the_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="placement_supervisor.daemon"):
        line = log_stop_budget(10.0, 10.0, has_engine=True, pid=4242)
        assert line is not None and "worst_s=22" in line and "stop_grace_s=10" in line
        assert log_stop_budget(10.0, 30.0, has_engine=True, pid=1) is None  # fits
        assert log_stop_budget(10.0, 10.0, has_engine=False, pid=1) is not None  # 12 > 10
        assert log_stop_budget(10.0, None, has_engine=True, pid=4242) is None
        hint = log_stop_budget(10.0, None, has_engine=True, pid=1)  # a container's PID 1
        assert hint is not None and "stop_grace_s=unset" in hint
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "INFO"]
