"""Engines that bind themselves (issue 9 item 5): `self_rebind` drift, pure and with a real daemon.

A process whose every thread sits on the same CPUs outside its slot bound
itself as a whole (vLLM --numa-bind, SGLang's numactl wrapper, torchrun
--numa-binding); it is reported as `self_rebind` and fixed or left by that
kind's policy. One thread off its role stays `thread_affinity`; narrowing
inside the slot is left alone.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from supervisor.plan.placement import Slot
from supervisor.state import Finding, Observation, ThreadObservation
from supervisor.watch.drift import diff
from tests.support.children import thread_cpus
from tests.support.daemon_support import (
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

SLOT = Slot(cpus=(2, 3, 4, 5), mems=(0,), roles={"main": (2, 3, 4), "acl": (5,)})


def obs(*threads: tuple[int, str, tuple[int, ...]]) -> Observation:
    return Observation(
        tuple(ThreadObservation(tid, "t", role, cpus) for tid, role, cpus in threads),
        MappingProxyType({}),
        None,
        (),
        1.0,
    )


def test_a_whole_process_outside_its_slot_is_self_rebind() -> None:
    moved = obs((10, "main", (0, 1)), (11, "acl", (0, 1)))
    assert diff(SLOT, moved, threshold=0.9) == (
        Finding("self_rebind", "tid 10", "2-4", "0-1"),
        Finding("self_rebind", "tid 11", "5", "0-1"),
    )


@pytest.mark.parametrize(
    "threads",
    [
        # One thread pushed out: thread_affinity, as before.
        ((10, "main", (2, 3, 4)), (11, "acl", (0,))),
        # Threads outside, but not as one: thread_affinity.
        ((10, "main", (0,)), (11, "acl", (1,))),
        # The whole process inside its slot, off its roles: thread_affinity.
        ((10, "main", (5,)), (11, "acl", (5,))),
    ],
)
def test_other_moves_stay_thread_affinity(threads: tuple[Any, ...]) -> None:
    findings = diff(SLOT, obs(*threads), threshold=0.9)
    assert findings and {f.kind for f in findings} == {"thread_affinity"}


def test_self_rebind_is_judged_per_process_of_the_tree() -> None:
    """A tree member (pid 77) that bound itself outside the slot is self_rebind
    while its owner's threads stay where they are; a member's single thread
    off its role stays thread_affinity."""

    def member(tid: int, role: str, cpus: tuple[int, ...], pid: int | None) -> ThreadObservation:
        return ThreadObservation(tid, "t", role, cpus, pid=pid)

    tree = Observation(
        (
            member(10, "main", (2, 3, 4), None),
            member(20, "main", (0, 1), 77),
            member(21, "acl", (0, 1), 77),
            member(30, "main", (2, 3, 4), 88),
            member(31, "acl", (0,), 88),
        )
    )
    assert diff(SLOT, tree, threshold=0.9) == (
        Finding("self_rebind", "tid 20", "2-4", "0-1"),
        Finding("self_rebind", "tid 21", "5", "0-1"),
        Finding("thread_affinity", "tid 31", "5", "0"),
    )


def test_narrowing_inside_the_slot_is_left_alone() -> None:
    assert diff(SLOT, obs((10, "main", (3,)), (11, "acl", (5,))), threshold=0.9) == ()


# The worker binds itself, as a launcher's numactl would, to the other rank's CPU
# once the daemon has placed it, then starts its threads (they inherit it).
SELF_BINDING = r"""
import os, sys, threading, time
out, rank = sys.argv[1], int(sys.argv[2])
time.sleep(1.5)
other = ({0, 1} - os.sched_getaffinity(0)) or {rank ^ 1}
os.sched_setaffinity(0, other)
for _ in range(2):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
open(out, "w").write(str(sorted(other)))
time.sleep(3600)
"""


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("policy", ["enforce", "observe"])
def test_a_worker_that_binds_itself_outside_its_slot(tmp_path: Path, policy: str) -> None:
    script = tmp_path / "self_binding.py"
    script.write_text(SELF_BINDING)
    done = tmp_path / "rebound"
    doc: dict[str, Any] = {
        "cpu_ranks": 2,
        "cgroup": "off",  # a rank cpuset would refuse the move outright
        "stop_timeout_s": 2,
        "workers": {"command": ["python", str(script), str(done), "{rank}"]},
        "placement": {"rank_roles": {}, "engine": {"enabled": False}},
    }
    text = (
        to_toml(doc) + f'[drift]\ncheck_interval_s = 0.2\npolicy = {{ self_rebind = "{policy}" }}\n'
    )
    config = tmp_path / "c.toml"
    config.write_text(text)
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as d:
        doc0 = poll(d.running, timeout_s=60)
        rank0 = doc0["ranks"][0]
        if rank0["cpus"] == doc0["ranks"][1]["cpus"]:
            pytest.skip("needs two CPUs")
        pid, planned = rank0["pid"], ",".join(map(str, rank0["cpus"]))
        poll(done.exists, timeout_s=30)
        counter = 'placement_drift_events_total{kind="self_rebind",rank="0"}'
        poll(lambda: metric(d.port, counter) >= 1, timeout_s=20, what=d.tail())
        if policy == "enforce":
            poll(lambda: set(thread_cpus(pid).values()) == {planned}, timeout_s=20)
        else:
            drift = (d.placement() or doc0)["ranks"][0]["drift"]
            assert drift and {f["kind"] for f in drift} == {"self_rebind"}
            assert all(f["action"] == "observe" for f in drift)
            assert planned not in set(thread_cpus(pid).values())  # left where it went
        assert d.stop(timeout_s=30) == 0
