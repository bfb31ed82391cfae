"""An adopted worker's decision (pure) and its binds through the one Applier: real
processes, their real threads, a real cgroup; a reused identity is never written."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from supervisor.bind.binder import Binder
from supervisor.bind.cgroup import CgroupManager, read_cgroup_setup
from supervisor.daemon.cgroups import ManagedCgroups
from supervisor.errors import translate_oserror
from supervisor.hostfs import HostFS
from supervisor.plan.placement import Slot
from supervisor.procfs.identity import ProcessId, ThreadId
from supervisor.trees.adopt import Candidate, adopt_process, read_adoptees
from supervisor.watch.adoption import Adoptee, adoption_result, decide_adoption
from supervisor.watch.apply import Applier
from supervisor.watch.settle import Outcome, Outcomes
from tests.support.children import ThreadedChild

FS = HostFS("/")
SLOT = Slot(cpus=(1,), mems=(0,))


def test_the_decision_binds_every_thread_of_every_process_and_moves_remote_pages() -> None:
    worker = Adoptee(ProcessId(100, 7), (ThreadId(100, 7), ThreadId(101, 8)))
    child = Adoptee(ProcessId(200, 9), (ThreadId(200, 9),))
    d = decide_adoption(3, [worker, child], Slot(cpus=(5, 4), mems=(1,)), [0, 1], join=True)
    assert (d.key, d.pid) == (3, 100)
    assert [(b.pid, b.id, b.cpus) for b in d.binds] == [
        (100, ThreadId(100, 7), (4, 5)),
        (100, ThreadId(101, 8), (4, 5)),
        (200, ThreadId(200, 9), (4, 5)),
    ]
    assert {b.reason for b in d.binds} == {"thread_role"}
    (move,) = d.moves
    assert (move.pid, move.from_nodes, move.to_nodes) == (100, (0,), (1,))
    assert d.joins == (ProcessId(100, 7), ProcessId(200, 9))
    # No cgroup: no join; one node: nothing to migrate.
    d = decide_adoption(3, [worker], Slot(cpus=(4,), mems=(0,)), [0], join=False)
    assert d.joins == () and d.moves == ()


def test_the_result_folds_what_the_applier_did() -> None:
    d = decide_adoption(
        0, [Adoptee(ProcessId(1, 2), (ThreadId(1, 2), ThreadId(3, 4)))], SLOT, [0, 1], join=True
    )
    refused = translate_oserror("tid 3", OSError(1, "Operation not permitted"))
    out = Outcomes(
        {1: Outcome(kept=(1,)), 3: Outcome(error=refused)},
        (Outcome(pages_left=5),),
        joins=(Outcome(),),
    )
    result = adoption_result(d, out, 1)
    assert not result.gone and result.cpus == (1,) and result.moved == 1
    assert result.pages_left == 5
    assert result.errors == (("thread", "denied", f"tid 3: {refused}"),)
    assert adoption_result(d, Outcomes(gone=True), 1).gone


def test_a_real_worker_is_bound_through_the_applier_and_a_reused_pid_is_not() -> None:
    applier = Applier(FS, Binder(FS), None, None)
    with ThreadedChild(["a", "b"]) as child:
        ident = ProcessId.read(FS, child.pid)
        assert ident is not None
        os.sched_setaffinity(child.pid, {0, 1})
        # Another start time: the pid names another process now. Nothing is written.
        stale = Candidate(ProcessId(child.pid, ident.start_time + 1), os.getpid())
        result = adopt_process(FS, applier, 0, stale, [child.pid], SLOT, [0], False)
        assert result.gone
        assert all(os.sched_getaffinity(t) == {0, 1} for t in child.threads.values())
        candidate = Candidate(ident, os.getpid())
        (adoptee,) = read_adoptees(FS, candidate, [child.pid])
        assert {t.tid for t in adoptee.threads} >= set(child.threads.values())
        result = adopt_process(FS, applier, 0, candidate, [child.pid], SLOT, [0], False)
        assert not result.gone and result.errors == () and result.cpus == (1,)
        assert result.moved == 1
        for tid in os.listdir(f"/proc/{child.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == {1}


@pytest.fixture
def cgroups(need_root: None) -> Iterator[ManagedCgroups]:
    setup, why = read_cgroup_setup(FS)
    if setup is None:
        pytest.skip(f"no writable cgroup subtree here: {why}")
    if setup.version == 2 and setup.evict_self:
        pytest.skip("would move the test runner into a leaf cgroup")
    managed = ManagedCgroups(
        CgroupManager(FS, setup, suffix=f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    )
    yield managed
    for key in list(managed.made):
        managed.remove(key)
    managed.close()


def test_the_applier_joins_the_rank_s_cgroup_before_binding(cgroups: ManagedCgroups) -> None:
    cgroups.create(0, SLOT)
    pc = cgroups.made[0]
    applier = Applier(FS, Binder(FS), None, cgroups)
    with ThreadedChild(["a"]) as child:
        ident = ProcessId.read(FS, child.pid)
        assert ident is not None
        stale = Candidate(ProcessId(child.pid, ident.start_time + 1), os.getpid())
        (out,) = applier.apply(
            [decide_adoption(0, [Adoptee(stale.id, ())], SLOT, [0], join=True)],
            {0: stale.id},
        )
        assert out.gone and cgroups.manager.read_procs(pc) == []
        candidate = Candidate(ident, os.getpid())
        result = adopt_process(FS, applier, 0, candidate, [child.pid], SLOT, [0], True)
        assert result.errors == () and result.moved == 1
        assert cgroups.manager.read_procs(pc) == [child.pid]
        assert result.cpus == (1,)
        child.proc.kill()
        child.proc.wait()
