"""supervisor.watch.steady: when a pass may publish without deciding again (pure)."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from supervisor.state import CgroupObservation, Observation, ThreadObservation
from supervisor.watch.decide import RepairState, Seen, after_replan, decide
from supervisor.watch.settle import Outcomes, settle
from supervisor.watch.steady import mark_of
from tests.watch.test_decide import NOW, SLOT, policy

THREADS = (
    ThreadObservation(100, "python", "main", (0, 1)),
    ThreadObservation(101, "x", "main", (0, 1)),
)


def _pass(obs: Observation, state: RepairState, pol=None, *, read=True):  # type: ignore[no-untyped-def]
    pol = pol or policy()
    d = decide(SLOT, Seen(0, 4242, obs, read), state, pol, NOW)
    s = settle(d, Outcomes(), pol, NOW)
    return d, s, mark_of(d, s, SLOT, pol, {"pid": 4242})


def test_a_clean_pass_is_marked_and_the_mark_holds_for_the_same_view_only() -> None:
    pol = policy()
    obs = Observation(THREADS, MappingProxyType({0: 1 << 20}), 1.0)
    _, s, mark = _pass(obs, RepairState(), pol)
    assert mark is not None and mark.state is s.state
    again = replace(obs, observed_at=5.0)  # a later pass: the same tuple, a new time
    assert mark.holds(SLOT, pol, s.state, again)
    # Deciding again would find the same: nothing (the skip loses nothing).
    d2, s2, _ = _pass(again, s.state, pol)
    assert d2.findings == () and d2.binds == () and s2.remaining == ()
    # Anything else seen, or another slot, policy or state: decide again.
    rebuilt = tuple(replace(t) for t in THREADS)
    assert not mark.holds(SLOT, pol, s.state, replace(obs, threads=rebuilt))
    assert not mark.holds(SLOT, pol, s.state, replace(obs, local_memory_ratio=0.5))
    assert not mark.holds(SLOT, pol, s.state, replace(obs, memory_bytes_by_node={0: 2}))
    gone = CgroupObservation(("/sys/fs/cgroup/memory/x",), None, None, False)
    assert not mark.holds(SLOT, pol, s.state, replace(obs, cgroup=gone))
    assert not mark.holds(replace(SLOT, mems=(1,)), pol, s.state, obs)
    assert not mark.holds(SLOT, policy(), s.state, obs)  # a reload's policy
    assert not mark.holds(SLOT, pol, after_replan(s.state), obs)


def test_a_pass_that_found_or_started_anything_is_not_marked() -> None:
    off = (ThreadObservation(100, "python", "main", (2,)),)  # main belongs on 0-1
    placed = RepairState(placed={100: "main"})
    assert _pass(Observation(off), placed)[2] is None  # drift, re-bound
    mostly = Observation(THREADS, MappingProxyType({0: 95 << 20, 1: 5 << 20}), 0.95)
    assert _pass(mostly, RepairState(repairing=True))[2] is None  # a repair goes on to 0.99
    stale = RepairState(memory_stale=True)  # migrated: memory to be read again
    assert _pass(Observation(THREADS), stale, read=False)[2] is None
    remote = Observation(THREADS, MappingProxyType({0: 1 << 20, 1: 64 << 20}), 0.02)
    assert _pass(remote, RepairState())[2] is None  # memory_locality
    assert _pass(Observation(THREADS), RepairState(), policy(cause="api"))[2] is None
