"""supervisor.watch.decide and settle as tables: one row per branch of the loop's policy (pure).

Each row builds one observation and one previous repair state, decides, and
checks what the branch must produce; a row fails when its branch is broken
(no bind where one is due, a wrong reason, a drift counted twice, a
migration inside a backoff, a repair that stops early or never stops).
"""

from __future__ import annotations

import errno
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest

from supervisor.config import DriftConfig
from supervisor.errors import translate_oserror
from supervisor.plan.keys import ThreadRole
from supervisor.plan.placement import Slot
from supervisor.plan.threads import RoleMatcher
from supervisor.procfs.identity import ThreadId
from supervisor.state import IrqObservation, Observation, ThreadObservation
from supervisor.watch.decide import (
    MIGRATE_NO_GAIN_BACKOFF_S,
    Decision,
    MemoryMove,
    MoveRecord,
    RepairState,
    Seen,
    ThreadBind,
    after_replan,
    decide,
)
from supervisor.watch.policy import Policy
from supervisor.watch.settle import Outcome, Outcomes, moved_by_plan, note_failure, settle

MIB = 1 << 20
# main on CPUs 0-1, comm on 2, node 0; four nodes exist.
SLOT = Slot((0, 1, 2), (0,), {"main": (0, 1), "comm": (2,)})
NOW = 1000.0
ENFORCE_ALL = {
    "thread_affinity": "enforce",
    "memory_locality": "enforce",
    "irq_affinity": "enforce",
}
OBSERVE_ALL = dict.fromkeys(ENFORCE_ALL, "observe")


def policy(actions: dict[str, str] | None = None, cause: str = "check", **more: Any) -> Policy:
    drift = DriftConfig(
        policy=MappingProxyType(dict(ENFORCE_ALL if actions is None else actions)),  # type: ignore[arg-type]
        local_memory_threshold=0.9,
        migrate_max_bytes_per_s=100 * MIB,
        check_interval_s=1.0,
    )
    return Policy.of(drift, cause, **more)  # type: ignore[arg-type]


def thread(
    tid: int, role: str, cpus: tuple[int, ...], name: str | None = None
) -> ThreadObservation:
    return ThreadObservation(tid, name or role, role, cpus, id=ThreadId(tid, tid * 10))


def observation(
    threads: tuple[ThreadObservation, ...] = (),
    memory: dict[int, int] | None = None,
    irqs: tuple[IrqObservation, ...] = (),
) -> Observation:
    mem = memory or {}
    total = sum(mem.values())
    ratio = mem.get(0, 0) / total if total else None
    return Observation(threads, MappingProxyType(mem), ratio, irqs)


def seen(obs: Observation, memory_read: bool = True) -> Seen:
    return Seen(0, 4242, obs, memory_read)


def run(
    obs: Observation,
    state: RepairState | None = None,
    pol: Policy | None = None,
    *,
    memory_read: bool = True,
    others: dict[Any, MoveRecord] | None = None,
) -> Decision:
    return decide(
        SLOT,
        seen(obs, memory_read),
        state or RepairState(),
        pol or policy(),
        NOW,
        others=others,
    )


def memory(local_mib: int, remote_mib: int) -> dict[int, int]:
    return {0: local_mib * MIB, 1: remote_mib * MIB}


# -- threads --------------------------------------------------------------------------

MAIN_OK = thread(100, "main", (0, 1))
COMM_WRONG = thread(101, "comm", (0, 1))  # comm belongs on 2
PLACED = RepairState(placed={100: "main", 101: "comm"})


THREAD_ROWS: list[tuple[Any, ...]] = [
    # A thread once placed, now off its role's CPUs: drift, re-bound, counted.
    ("drift", (MAIN_OK, COMM_WRONG), PLACED, policy(), [(101, (2,), "thread_affinity")], 1),
    # Never seen on its CPUs: a new thread's role binding, not drift.
    (
        "new role",
        (MAIN_OK, COMM_WRONG),
        RepairState(),
        policy(),
        [(101, (2,), "thread_role")],
        0,
    ),
    # Under observe a new thread is drift all the same, and nothing binds.
    ("observe", (MAIN_OK, COMM_WRONG), RepairState(), policy(OBSERVE_ALL), [], 1),
    # Pinned by the workload inside its role's CPUs: respected.
    ("pinned", (thread(100, "main", (1,)),), PLACED, policy(), [], 0),
    # ...unless enforce_pinned.
    (
        "enforce pinned",
        (thread(100, "main", (1,)),),
        PLACED,
        replace(policy(), enforce_pinned=True),
        [(100, (0, 1), "thread_affinity")],
        1,
    ),
    # Already counted last pass: bound again, not counted again.
    (
        "counted once",
        (MAIN_OK, COMM_WRONG),
        replace(PLACED, reported=frozenset({("thread_affinity", "tid 101")})),
        policy(),
        [(101, (2,), "thread_affinity")],
        0,
    ),
    # POST /rebind enforces whatever the policy says, with reason "api".
    ("api", (MAIN_OK, COMM_WRONG), PLACED, policy(OBSERVE_ALL, "api"), [(101, (2,), "api")], 1),
    # A new plan's binds: reason cpuset_changed, no drift counted.
    (
        "cpuset",
        (MAIN_OK, COMM_WRONG),
        PLACED,
        policy(OBSERVE_ALL, "cpuset_changed"),
        [(101, (2,), "cpuset_changed")],
        0,
    ),
    ("all placed", (MAIN_OK, thread(101, "comm", (2,))), PLACED, policy(), [], 0),
    # A thread of a tree member (a spawn child): decided as the owner's own.
    (
        "tree member drift",
        (MAIN_OK, replace(COMM_WRONG, pid=5151)),
        PLACED,
        policy(),
        [(101, (2,), "thread_affinity")],
        1,
    ),
    (
        "tree member new",
        (MAIN_OK, replace(COMM_WRONG, pid=5151)),
        None,
        policy(),
        [(101, (2,), "thread_role")],
        0,
    ),
    (
        "tree member observe",
        (MAIN_OK, replace(COMM_WRONG, pid=5151)),
        PLACED,
        policy(OBSERVE_ALL),
        [],
        1,
    ),
]


@pytest.mark.parametrize("row", THREAD_ROWS, ids=[r[0] for r in THREAD_ROWS])
def test_thread_rows(row: tuple[Any, ...]) -> None:
    name, threads, state, pol, binds, counted = row
    d = run(observation(threads), state, pol)
    assert [(b.tid, b.cpus, b.reason) for b in d.binds] == binds, name
    assert [b.pid for b in d.binds] == [t.pid for t in threads if t.tid in {b.tid for b in d.binds}]
    assert len([f for f in d.new_drift if f.kind == "thread_affinity"]) == counted, name
    for b in d.binds:  # the bind names the thread the scan saw, by start time
        assert b.id == ThreadId(b.tid, b.tid * 10)


def test_a_tree_member_s_thread_is_bound_in_its_own_process() -> None:
    """The bind names the member's pid: the applier checks the tid's Tgid against it."""
    member = replace(COMM_WRONG, pid=5151)
    d = run(observation((MAIN_OK, member)), PLACED)
    assert [(b.tid, b.pid) for b in d.binds] == [(101, 5151)]
    assert [(b.tid, b.pid) for b in run(observation((COMM_WRONG,)), PLACED).binds] == [(101, None)]
    s = settle(d, Outcomes({101: Outcome(kept=(2,))}), policy(), NOW)
    assert s.state.placed[101] == "comm" and s.remaining == ()


def test_a_thread_narrowed_by_our_own_bind_is_not_a_workload_pin() -> None:
    # We bound tid 100 to CPU 0 under an older plan; main is 0-1 again now.
    ours = RepairState(placed={100: "main"}, bound={100: (0,)})
    d = run(observation((thread(100, "main", (0,)),)), ours, policy(cause="cpuset_changed"))
    assert [(b.tid, b.cpus, b.reason) for b in d.binds] == [(100, (0, 1), "cpuset_changed")]
    # The workload's own pin (not what we set) stays respected.
    theirs = RepairState(placed={100: "main"}, bound={100: (0, 1)})
    assert run(observation((thread(100, "main", (0,)),)), theirs).binds == ()
    # A successful bind is remembered; a gone thread is forgotten.
    s = settle(d, Outcomes({100: Outcome(kept=(0, 1))}), policy(), NOW)
    assert s.state.bound == {100: (0, 1)}
    assert run(observation(()), s.state).state.bound == {}


def test_threads_on_their_cpus_become_placed_and_gone_ones_are_forgotten() -> None:
    d = run(observation((MAIN_OK, thread(102, "comm", (2,)))), PLACED)
    assert dict(d.state.placed) == {100: "main", 102: "comm"}  # 101 exited
    # A thread found off its CPUs is not placed by being seen.
    d = run(observation((MAIN_OK, COMM_WRONG)))
    assert dict(d.state.placed) == {100: "main"}


def test_only_threads_off_their_roles_cpus_are_bound() -> None:
    # (Moved from the old plan_thread_affinity test: the one thread planner is decide.)
    slot = Slot(tuple(range(8)), (0,), {"irq": (0, 1), "main": (2, 3, 4, 5), "release": (7,)})
    matcher = RoleMatcher("workers", (ThreadRole("release", "workers", "release_thread*"),))

    def named(tid: int, name: str, cpus: tuple[int, ...]) -> ThreadObservation:
        return ThreadObservation(tid, name, matcher.role(name), cpus)

    threads = (
        named(100, "python3", tuple(range(8))),  # born with the whole slot -> main
        named(102, "release_thread", (2, 3)),  # on main's CPUs -> release
        named(103, "python3", (4,)),  # pinned by the workload inside main
        named(104, "python3", (2, 3, 4, 5)),  # right
        named(105, "hccl_poll", tuple(range(8))),  # no comm role in the slot: main's CPUs
    )
    d = decide(slot, seen(observation(threads)), RepairState(), policy(), NOW)
    assert [(b.tid, b.role, b.cpus) for b in d.binds] == [
        (100, "main", (2, 3, 4, 5)),
        (102, "release", (7,)),
        (105, "main", (2, 3, 4, 5)),
    ]
    pinned = decide(
        slot, seen(observation(threads)), RepairState(), replace(policy(), enforce_pinned=True), NOW
    )
    assert [b.tid for b in pinned.binds] == [100, 102, 103, 105]


# -- memory ---------------------------------------------------------------------------


MEMORY_ROWS: list[tuple[Any, ...]] = [
    # Below the threshold under enforce: a repair starts, the remote MiB move.
    ("start", memory(50, 50), RepairState(), policy(), [((1,), (0,), 50 * MIB)], True),
    # Below the threshold but too little remote to be worth a page walk.
    ("floor", memory(2, 3), RepairState(), policy(), [], True),
    # Under observe: reported, never moved, no repair.
    ("observe", memory(50, 50), RepairState(), policy(OBSERVE_ALL), [], False),
    # A repair goes on above the threshold, to 0.99, whatever the floor.
    (
        "repair goes on",
        memory(200, 3),
        RepairState(repairing=True),
        policy(),
        [((1,), (0,), 3 * MIB)],
        True,
    ),
    # ...and stops there.
    ("repair stops", memory(995, 1), RepairState(repairing=True), policy(), [], False),
    # A repair under a policy that no longer enforces does nothing.
    (
        "repair observe",
        memory(200, 3),
        RepairState(repairing=True),
        policy({"memory_locality": "observe"}),
        [],
        True,
    ),
    # Inside the rate-limit / backoff window: no move.
    ("backoff", memory(50, 50), RepairState(migrate_after=NOW + 1), policy(), [], True),
    # The API ignores the backoff and the floor.
    (
        "api",
        memory(2, 3),
        RepairState(migrate_after=NOW + 1),
        policy(OBSERVE_ALL, "api"),
        [((1,), (0,), 3 * MIB)],
        True,
    ),
    # Well placed: nothing.
    ("local", memory(100, 0), RepairState(), policy(), [], False),
]


@pytest.mark.parametrize("row", MEMORY_ROWS, ids=[r[0] for r in MEMORY_ROWS])
def test_memory_rows(row: tuple[Any, ...]) -> None:
    name, mem, state, pol, moves, repairing = row
    d = run(observation(memory=mem), state, pol)
    assert [(m.from_nodes, m.to_nodes, m.remote_bytes) for m in d.moves] == moves, name
    assert d.state.repairing is repairing, name


def test_stale_memory_is_not_acted_on_until_read_again() -> None:
    stale = RepairState(memory_stale=True, repairing=True)
    assert run(observation(memory=memory(50, 50)), stale, memory_read=False).moves == ()
    assert run(observation(memory=memory(200, 3)), stale, memory_read=False).moves == ()
    fresh = run(observation(memory=memory(50, 50)), stale, memory_read=True)
    assert len(fresh.moves) == 1 and not fresh.state.memory_stale


def test_tug_of_war_backs_off() -> None:
    # This process moved pages 1 -> 0 20 s ago; another moved 0 -> 1 since:
    # the same shared pages. Pulling them back would start the war again.
    state = RepairState(last_move=MoveRecord((1,), (0,), NOW - 20))
    war = {1: MoveRecord((0,), (1,), NOW - 10)}
    d = run(observation(memory=memory(50, 50)), state, others=war)
    assert d.moves == ()
    assert d.state.migrate_after == NOW + MIGRATE_NO_GAIN_BACKOFF_S
    assert [n.kind for n in d.notes] == ["migrate"] and "other way" in d.notes[0].message
    # The other move happened first: no war, this one moves.
    older = {1: MoveRecord((0,), (1,), NOW - 30)}
    assert len(run(observation(memory=memory(50, 50)), state, others=older).moves) == 1
    # The other move went elsewhere (node 2 -> 3): no war.
    elsewhere = {1: MoveRecord((2,), (3,), NOW - 10)}
    assert len(run(observation(memory=memory(50, 50)), state, others=elsewhere).moves) == 1
    # Long ago: no war.
    old = RepairState(last_move=MoveRecord((1,), (0,), NOW - MIGRATE_NO_GAIN_BACKOFF_S - 1))
    long_ago = {1: MoveRecord((0,), (1,), NOW - MIGRATE_NO_GAIN_BACKOFF_S)}
    assert len(run(observation(memory=memory(50, 50)), old, others=long_ago).moves) == 1
    # The API ignores the war.
    api = policy(OBSERVE_ALL, "api")
    assert len(run(observation(memory=memory(50, 50)), state, api, others=war).moves) == 1


@pytest.mark.parametrize(
    ("after_local_mib", "backs_off"),
    [(51, True), (90, False)],  # 0.50 -> 0.505: no gain; 0.50 -> 0.643: gain
)
def test_a_migration_that_did_not_help_backs_off(after_local_mib: int, backs_off: bool) -> None:
    state = RepairState(migrated_from=0.5, memory_stale=True, migrate_after=NOW - 1)
    d = run(observation(memory=memory(after_local_mib, 50)), state, policy(OBSERVE_ALL))
    assert d.state.migrated_from is None  # judged once
    assert (d.state.migrate_after >= NOW + MIGRATE_NO_GAIN_BACKOFF_S) is backs_off
    assert bool(d.notes) is backs_off
    # Not judged before memory was read again.
    unread = run(observation(memory=memory(51, 50)), state, memory_read=False)
    assert unread.state.migrated_from == 0.5 and not unread.notes


# -- IRQs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "irq", "pol", "reason", "counted"),
    [
        ("drift", IrqObservation(41, (5,), (2,)), policy(), "irq_affinity", 1),
        ("observe", IrqObservation(41, (5,), (2,)), policy(OBSERVE_ALL), None, 1),
        ("api", IrqObservation(41, (5,), (2,)), policy(OBSERVE_ALL, "api"), "api", 1),
        # Delivered within its planned CPUs (narrowed by irqbalance): fine.
        ("within", IrqObservation(41, (2,), (2, 3)), policy(), None, 0),
        # Not ours to keep (managed, refused): planned is empty.
        ("not kept", IrqObservation(41, (5,), ()), policy(), None, 0),
    ],
)
def test_irq_rows(
    name: str, irq: IrqObservation, pol: Policy, reason: str | None, counted: int
) -> None:
    d = run(observation(irqs=(irq,)), RepairState(), pol)
    assert d.irq_reason == reason, name
    assert len(d.new_drift) == counted, name


# -- a new plan -----------------------------------------------------------------------


def test_a_new_plan_moves_memory_only_when_no_cgroup_does() -> None:
    pol = policy(cause="cpuset_changed", move_memory=True, node_ids=(0, 1, 2, 3))
    d = run(observation((MAIN_OK,), memory(50, 50)), after_replan(PLACED), pol)
    assert [(m.from_nodes, m.to_nodes, m.reason) for m in d.moves] == [
        ((1, 2, 3), (0,), "cpuset_changed")
    ]
    assert d.new_drift == ()  # the pass after the re-plan reports memory
    quiet = run(observation((MAIN_OK,), memory(50, 50)), PLACED, policy(cause="cpuset_changed"))
    assert quiet.moves == ()


def test_moved_by_plan_counts_threads_a_cgroup_write_moved() -> None:
    old = Slot((4, 5, 6), (1,), {"main": (4, 5), "comm": (6,)})
    obs = observation((MAIN_OK, COMM_WRONG, thread(103, "main", (4, 5))))
    bind = ThreadBind(101, "comm", "comm", (2,), "cpuset_changed")
    # 100 is on main's new CPUs without a bind; 101 was bound; 103 stayed behind.
    assert moved_by_plan(old, SLOT, obs, [bind]) == 1
    assert moved_by_plan(SLOT, SLOT, obs, []) == 0  # nothing changed for anyone


# -- settling -------------------------------------------------------------------------


def invalid() -> Any:
    return translate_oserror("tid 101", OSError(errno.EINVAL, "Invalid argument"))


def test_settle_records_binds_failures_once_and_migrations() -> None:
    obs = observation((MAIN_OK, COMM_WRONG), memory(50, 50))
    d = run(obs, PLACED)
    assert len(d.binds) == 1 and len(d.moves) == 1
    ok = settle(d, Outcomes({101: Outcome(kept=(2,))}, (Outcome(pages_left=3),)), policy(), NOW)
    assert [b.tid for b in ok.rebound["thread_affinity"]] == [101]
    assert ok.state.placed[101] == "comm"
    assert ok.remaining == tuple(f for f in d.findings if f.kind == "memory_locality")
    assert {t.tid: t.cpus for t in ok.observation.threads}[101] == (2,)
    (move, left) = ok.migrated[0]
    assert left == 3 and isinstance(move, MemoryMove)
    # The next migration waits for the bytes at the rate (50 MiB at 100 MiB/s
    # is 0.5 s, less than one interval: one interval), memory is re-read.
    assert ok.state.migrate_after == NOW + 1.0
    assert ok.state.memory_stale and ok.state.migrated_from == 0.5
    assert ok.state.last_move == MoveRecord((1,), (0,), NOW)

    failed = settle(
        d, Outcomes({101: Outcome(error=invalid())}, (Outcome(gone=True),)), policy(), NOW
    )
    assert [f.target for f in failed.failures] == ["thread"]
    assert [f.action for f in failed.remaining if f.kind == "thread_affinity"] == ["failed"]
    # The same failure next pass is not new; a success clears it.
    again = replace(d, state=failed.state)
    assert settle(again, Outcomes({101: Outcome(error=invalid())}), policy(), NOW).failures == ()
    cleared = settle(again, Outcomes({101: Outcome(kept=(2,))}), policy(), NOW)
    assert cleared.state.failures == {}
    # A thread gone (exited or its tid reused) is nothing left to fix.
    gone = settle(d, Outcomes({101: Outcome(gone=True)}), policy(), NOW)
    assert not gone.failures and not gone.rebound and gone.state.placed == d.state.placed


def test_note_failure_is_new_once_per_reason() -> None:
    state, new = note_failure(RepairState(), "process", "pid 7", "error")
    assert new
    assert note_failure(state, "process", "pid 7 (detail)", "error") == (state, False)
    assert note_failure(state, "process", "pid 7", "denied")[1]


def test_the_same_threads_reuse_the_last_thread_findings_until_an_input_changes() -> None:
    """The scanner hands back the same tuple while nothing changed; decide then
    reuses the last pass's thread findings, and computes them again as soon as
    the threads, the slot, our binds or the pinned rule differ."""
    threads = (MAIN_OK, COMM_WRONG)
    first = run(observation(threads), PLACED, policy(OBSERVE_ALL))
    assert [f.target for f in first.findings] == ["tid 101"]
    check = first.state.thread_check
    assert check is not None and check.threads is threads
    again = run(observation(threads), first.state, policy(OBSERVE_ALL))
    assert again.state.thread_check is check  # reused: no walk over the threads
    assert [f.target for f in again.findings] == ["tid 101"]
    # Another slot (a re-plan put comm on CPUs 0-1): the same threads, no drift.
    wider = Slot((0, 1, 2), (0,), {"main": (0, 1), "comm": (0, 1)})
    moved = decide(wider, Seen(0, 4242, observation(threads), True), again.state, policy(), NOW)
    assert moved.findings == () and moved.state.thread_check is not check
    # Equal threads in a new tuple (a scan that rebuilt them) are checked afresh.
    fresh = run(observation((MAIN_OK, thread(101, "comm", (2,)))), again.state, policy())
    assert fresh.findings == () and fresh.state.thread_check is not check
    # The same tuple, but now our own bind pinned it: the pinned rule says otherwise.
    narrowed = (thread(100, "main", (0,)),)
    theirs = run(observation(narrowed), PLACED, policy())
    assert theirs.findings == ()  # the workload's pin inside its role's CPUs
    ours = run(observation(narrowed), replace(theirs.state, bound={100: (0,)}), policy())
    assert [f.target for f in ours.findings] == ["tid 100"]


def test_memory_locality_auto_moves_only_for_a_process_not_bound_from_birth() -> None:
    """The default: an adopted worker's (or the engine's) remote pages are moved;
    a spawned worker under MPOL_BIND to its nodes is only observed."""
    auto = policy({"memory_locality": "auto"})
    obs = observation(memory=memory(50, 50))
    adopted = decide(SLOT, Seen(0, 4242, obs, True, False), RepairState(), auto, NOW)
    assert [(m.from_nodes, m.to_nodes, m.reason) for m in adopted.moves] == [
        ((1,), (0,), "memory_locality")
    ]
    assert [(f.kind, f.action) for f in adopted.findings] == [("memory_locality", "enforce")]
    spawned = decide(SLOT, Seen(0, 4242, obs, True, True), RepairState(), auto, NOW)
    assert spawned.moves == ()
    assert [(f.kind, f.action) for f in spawned.findings] == [("memory_locality", "observe")]


def test_the_loops_moves_take_one_passs_share_of_the_rate_and_the_api_everything() -> None:
    """100 MiB/s x 1 s checks: 300 MiB remote moves 100 MiB a pass, private
    pages only (max_bytes), so the next pass goes on at the rate."""
    d = run(observation(memory=memory(100, 300)))
    (move,) = d.moves
    assert (move.remote_bytes, move.max_bytes) == (100 * MIB, 100 * MIB)
    api = run(observation(memory=memory(100, 300)), pol=policy(OBSERVE_ALL, "api"))
    (whole,) = api.moves
    assert (whole.remote_bytes, whole.max_bytes) == (300 * MIB, 0)  # migrate_pages(2), all


def test_auto_follows_an_unbound_process_above_the_threshold_too() -> None:
    """An adopted worker keeps taking pages off its node (a policy not ours):
    "auto" moves them whenever it is below the repair target and they are
    worth a walk, not only once the ratio falls below the threshold."""
    auto = policy({"memory_locality": "auto"})
    above = observation(memory=memory(190, 10))  # 0.95: above the 0.9 threshold
    adopted = decide(SLOT, Seen(0, 4242, above, True, False), RepairState(), auto, NOW)
    assert [(m.from_nodes, m.remote_bytes) for m in adopted.moves] == [((1,), 10 * MIB)]
    assert adopted.findings == ()  # not a finding: above the threshold
    small = observation(memory=memory(300, 2))  # 2 MiB remote: below the floor
    assert decide(SLOT, Seen(0, 4242, small, True, False), RepairState(), auto, NOW).moves == ()
    spawned = decide(SLOT, Seen(0, 4242, above, True, True), RepairState(), auto, NOW)
    assert spawned.moves == ()
