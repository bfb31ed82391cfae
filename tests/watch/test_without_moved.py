"""A decision's binds of tree members that left its tree since the scan are dropped
(an adopted worker is never bound to the engine's CPUs, outside its rank's cpuset)."""

from __future__ import annotations

from types import MappingProxyType

from supervisor.state import Observation
from supervisor.watch.decide import Decision, MemoryMove, ThreadBind, without_moved


def bind(tid: int, pid: int | None) -> ThreadBind:
    return ThreadBind(tid, "python", "main", (0,), "thread_affinity", pid=pid)


def test_binds_and_moves_of_members_no_longer_in_the_tree_are_dropped() -> None:
    d = Decision(
        "engine",
        100,
        Observation((), MappingProxyType({}), None, ()),
        (),
        (),
        binds=(bind(100, None), bind(101, 100), bind(171, 171), bind(172, 172), bind(180, 180)),
        moves=(
            MemoryMove(100, (1,), (0,), 1, 0.5, "memory_locality"),
            MemoryMove(172, (1,), (0,), 1, 0.5, "memory_locality"),
        ),
    )
    # 171 and 172 were adopted (ranks' now); 180 is still the engine's.
    got = without_moved(d, frozenset({180}))
    assert [b.tid for b in got.binds] == [100, 101, 180]
    assert [m.pid for m in got.moves] == [100]
    assert without_moved(d, frozenset({171, 172, 180})) is d  # nothing moved: the same decision
