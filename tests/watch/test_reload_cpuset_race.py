"""A reload racing a cpuset change never leaves a stale plan in force (issue 30 item 4).

A real daemon in a v1 cpuset of its own (tests/support/cgroup_v1.py), real
SIGHUPs, real cpuset.cpus writes: each round sends a HUP and 0-30 ms later
toggles the cpuset between 0-1 and 1, so the reload's topology read lands
before or after the write. After every round the plan in force and every
worker thread's Cpus_allowed_list (read from /proc) must follow the live
cpuset. Before the fix a reload that had read the older topology installed
its plan after a pass had re-planned for the new set, and the loop, whose
remembered allowed set already matched the live one, never re-planned.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.support.cgroup_v1 import v1_available
from tests.support.daemon_support import (
    DaemonProcess,
    confined_daemon,
    rank_pids,
    thread_cpus_as_planned,
)
from tests.support.poll import poll

ROUNDS = 100
# Each rank's CPU per live cpuset (cpu_ranks = 2, on_shortage share on CPU 1 alone).
WANT = {"0-1": {0: "0", 1: "1"}, "1": {0: "1", 1: "1"}}


def _reloads_ok(d: DaemonProcess) -> int:
    doc = d.placement() or {}
    ok: int = doc.get("supervisor", {}).get("config_reloads", {}).get("ok", 0)
    return ok


@pytest.mark.timeout(900)
def test_hups_racing_cpuset_writes_always_end_on_the_live_set(tmp_path: Path) -> None:
    why = v1_available()
    if why is not None:
        pytest.skip(why)
    rng = random.Random(30_4)
    with confined_daemon(tmp_path, "race", interval_s=60.0, cpuset_watch_s=0.05) as (d, cg):
        doc = poll(
            lambda: (x := d.placement()) and thread_cpus_as_planned(x, WANT["0-1"]) and x,
            60,
            what="both ranks running on their own CPUs",
        )
        pids = rank_pids(doc)
        live = "0-1"
        settle_s: list[float] = []
        for n in range(1, ROUNDS + 1):
            live = "1" if live == "0-1" else "0-1"
            os.kill(d.pid, signal.SIGHUP)
            time.sleep(rng.uniform(0.0, 0.030))  # the race window under test, not a wait
            (cg / "cpuset.cpus").write_text(live)
            started = time.monotonic()

            def settled(n: int = n, live: str = live) -> bool:
                x = d.placement() or {}
                return _reloads_ok(d) >= n and thread_cpus_as_planned(x, WANT[live])

            try:
                poll(settled, 15, what=f"round {n}: plan and threads on cpuset {live}")
            except AssertionError:
                x = d.placement() or {}
                ranks = [(r["rank"], r["cpus"]) for r in x.get("ranks", [])]
                raise AssertionError(
                    f"round {n}: live cpuset {live}, plan in force {ranks}, "
                    f"reloads ok {_reloads_ok(d)}\n{d.tail(3000)}"
                ) from None
            settle_s.append(time.monotonic() - started)
        assert rank_pids(d.placement() or {}) == pids  # re-bound, never restarted
        settle_s.sort()
        print(
            f"{ROUNDS} rounds: settle median {settle_s[len(settle_s) // 2] * 1000:.0f} ms, "
            f"max {settle_s[-1] * 1000:.0f} ms"
        )
