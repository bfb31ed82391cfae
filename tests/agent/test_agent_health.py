"""The node agent's GET /healthz: the rule (pure), and a real agent answering it.

The rule: 200 while the last pass finished within 3 intervals (never less than
what one pass may wait on a child), 200 before the first pass during that same
grace, 503 naming the age after. A real `placement-supervisor agent` that
places nothing (a pod filter no pod matches) answers 200 with its pass age.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from supervisor.agent.node import HEALTH_FLOOR_S, health
from tests.support.daemon_support import REPO, daemon_env, free_port, stop_process
from tests.support.poll import poll


def test_a_recent_pass_is_healthy() -> None:
    status, doc = health(now=100.0, started_at=0.0, last_pass_at=99.5, interval_s=2, containers=3)
    assert status == 200
    assert doc == {"last_pass_age_s": 0.5, "containers": 3, "limit_s": HEALTH_FLOOR_S}


def test_a_pass_older_than_three_intervals_is_a_stuck_loop() -> None:
    interval_s = 60.0  # 3 intervals (180 s) above the floor: the rule is 3 x interval_s
    status, doc = health(
        now=1000.0, started_at=0.0, last_pass_at=1000.0 - 181, interval_s=interval_s, containers=1
    )
    assert status == 503
    assert doc["error"] == "last pass finished 181.0 s ago (limit 180.0 s)"
    ok, _ = health(now=1000.0, started_at=0.0, last_pass_at=821.0, interval_s=60, containers=1)
    assert ok == 200


def test_a_short_interval_is_not_stuck_while_a_pass_may_wait_on_a_child() -> None:
    # 3 x 2 s would fail the probe whenever a pass waits for a child to stop.
    now = 1000.0
    ok, _ = health(now=now, started_at=0, last_pass_at=now - 30, interval_s=2, containers=1)
    assert ok == 200
    bad, doc = health(
        now=now, started_at=0, last_pass_at=now - HEALTH_FLOOR_S - 1, interval_s=2, containers=1
    )
    assert bad == 503 and doc["last_pass_age_s"] == HEALTH_FLOOR_S + 1


def test_before_the_first_pass_a_grace_then_503() -> None:
    ok, doc = health(now=10.0, started_at=0.0, last_pass_at=None, interval_s=2, containers=0)
    assert ok == 200 and doc["last_pass_age_s"] is None
    late = HEALTH_FLOOR_S + 1
    bad, doc = health(now=late, started_at=0.0, last_pass_at=None, interval_s=2, containers=0)
    assert bad == 503
    assert doc["error"] == (
        f"no pass finished in the {late:.1f} s since start (limit {HEALTH_FLOOR_S:.1f} s)"
    )


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


@pytest.mark.usefixtures("need_root")
def test_a_real_agent_answers_healthz_with_its_pass_age(tmp_path: Path) -> None:
    port = free_port()
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "supervisor", "agent"),
            *("--listen", f"127.0.0.1:{port}", "--interval-s", "0.2"),
            *("--pod", str(uuid.uuid4()), "--state-dir", str(tmp_path / "state")),
        ],
        cwd=REPO,
        env=daemon_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        def passed() -> dict[str, Any] | None:
            try:
                status, doc = _get(f"http://127.0.0.1:{port}/healthz")
            except OSError:
                return None
            assert status == 200, doc
            return doc if doc["last_pass_age_s"] is not None else None

        doc = poll(passed, 30, interval_s=0.1, what="the agent's first pass")
        assert doc["containers"] == 0
        assert 0 <= doc["last_pass_age_s"] < HEALTH_FLOOR_S
    finally:
        stop_process(agent, 30)
