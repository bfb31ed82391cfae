"""supervisor.watch.scan.track: what each pass reads of each process (pure, no I/O)."""

from __future__ import annotations

from dataclasses import replace

from supervisor.bind.cgroup import ProcessCgroup
from supervisor.hostfs import HostFS
from supervisor.plan.keys import ProcKey
from supervisor.plan.placement import Slot
from supervisor.plan.threads import RoleMatcher, role_kinds
from supervisor.procfs.identity import ProcessId
from supervisor.state import ProcessStatus, ThreadObservation
from supervisor.watch.scan import ScanTarget, Tracked, track, tree_threads

SLOT = Slot((0, 1), (0,), {"main": (0, 1)})
OWN = ProcessCgroup("rank0", 1, None, "sys/fs/cgroup/memory/ps/rank0", ("/x",))
MATCHERS = {
    kinds: RoleMatcher(kinds, ())
    for kinds in (role_kinds("engine", False), role_kinds(0, False), role_kinds(0, True))
}


def _targets(
    tracked: dict[ProcKey, Tracked], now: float, *, cgroup: bool
) -> dict[ProcKey, ScanTarget]:
    statuses = [
        ProcessStatus(0, "running", 4242, ProcessId(4242, 7), cgroup="rank0" if cgroup else None),
        ProcessStatus(1, "running", 4343, ProcessId(4343, 8)),
    ]
    return {
        t.key: t
        for t in track(
            HostFS("/"),
            tracked,
            MATCHERS,
            [(s.key, s, SLOT) for s in statuses],
            {0: OWN} if cgroup else {},
            only=None,
            numa_maps_interval_s=10.0,
            numa_stat_interval_s=4.5,
            now=now,
        )
    }


def _read(tracked: dict[ProcKey, Tracked], targets: dict[ProcKey, ScanTarget], now: float) -> None:
    """What the pass does with a memory read: remember when."""
    for key, t in targets.items():
        if t.cgroup is not None or t.read_maps:
            tracked[key].maps_at = now


def test_a_cgroup_s_numa_stat_is_read_every_few_checks_and_at_once_when_stale() -> None:
    tracked: dict[ProcKey, Tracked] = {}
    reads: list[tuple[bool, bool]] = []  # (rank 0's numa_stat, rank 1's numa_maps)
    for second in range(12):
        targets = _targets(tracked, 100.0 + second, cgroup=True)
        reads.append((targets[0].cgroup is not None, targets[1].read_maps))
        assert targets[0].own is OWN and not targets[0].read_maps  # never numa_maps
        _read(tracked, targets, 100.0 + second)
    stat = [s for s, _ in reads]
    maps = [m for _, m in reads]
    assert stat == [True, False, False, False, False] * 2 + [True, False]
    assert maps == [True] + [False] * 9 + [True, False]
    # After a migration (or a new plan) the memory is stale: read at the next pass.
    tracked[0].state = replace(tracked[0].state, memory_stale=True)
    assert _targets(tracked, 112.0, cgroup=True)[0].cgroup is OWN


def test_a_process_without_its_own_memory_cgroup_reads_numa_maps_when_due() -> None:
    tracked: dict[ProcKey, Tracked] = {}
    first = _targets(tracked, 100.0, cgroup=False)
    assert first[0].cgroup is None and first[0].read_maps
    _read(tracked, first, 100.0)
    assert not _targets(tracked, 105.0, cgroup=False)[0].read_maps
    assert _targets(tracked, 110.0, cgroup=False)[0].read_maps


def test_a_tree_s_threads_are_the_same_tuple_while_every_part_is() -> None:
    """The process's and its members' tuples, joined: the last join handed back
    while each part is the very tuple its scanner returned (what lets decide
    reuse its thread findings for a worker with children), a new one otherwise."""
    tracked = _targets({}, 100.0, cgroup=False)[0].tracked
    own = (ThreadObservation(1, "python", "main", (0, 1)),)
    child = (ThreadObservation(2, "python", "main", (0, 1), pid=2),)
    joined = tree_threads(tracked, (own, child))
    assert joined == own + child
    assert tree_threads(tracked, (own, child)) is joined
    rebuilt = (ThreadObservation(2, "python", "main", (0,), pid=2),)
    assert tree_threads(tracked, (own, rebuilt)) == own + rebuilt
    assert tree_threads(tracked, (own,)) == own  # the child exited
