"""The check loop: scan -> decide -> apply -> publish (does I/O through scan and apply).

Every `check_interval_s` one pass (`CheckLoop.check_once`): the reads of
supervisor.watch.scan in the executor, one pure `decide.decide` per process,
the binds of supervisor.watch.apply in the executor, then `settle.settle` and
supervisor.watch.publish: the `StateStore` through the one `events.Recorder`
(on the loop: the store's single writer). The policy is in decide; this module holds
none. Slots and IRQs are the plan in force's (supervisor.in_force), which
this loop alone replaces, through `_install`: a change of the supervisor's allowed set
(cpuset write, CPU hotplug, seen by the pass or by the fast watch `watch_allowed`)
re-plans, and `install` (a config reload) takes a plan made elsewhere; either way the
pass decides the moved processes with cause "cpuset_changed" in its one decide/apply.
POST /rebind is `rebind`: one pass now with cause "api".
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from supervisor.config import Config, DriftConfig
from supervisor.cpulist import format_cpulist
from supervisor.errors import KernelError, SupervisorError
from supervisor.events import Recorder
from supervisor.hostfs import HostFS
from supervisor.in_force import Moved, PlanInForce
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcessKind, ProcKey, ThreadRole, key_label
from supervisor.plan.placement import Placement, Slot
from supervisor.plan.replan import AllowedSet, allowed_of, slots_by_key
from supervisor.plan.threads import DEFAULT_THREAD_ROLES, RoleMatcher, role_kinds, with_engine_roles
from supervisor.state import Finding, Observation, ProcessStatus, StateStore, Supervised
from supervisor.topology.cgroup import CpusetCache
from supervisor.topology.model import Topology
from supervisor.watch.apply import Applier, CgroupsLike
from supervisor.watch.cpuset import Replanning, moved_policies
from supervisor.watch.cpuset_watch import AllowedTrust, WatchState, start_watch
from supervisor.watch.decide import Decision, Seen, after_replan, decide, has_work, without_moved
from supervisor.watch.policy import Cause, Policy
from supervisor.watch.publish import publish_down, record_settled, summary_of
from supervisor.watch.scan import (
    NUMA_STAT_EVERY,
    IrqKeeperLike,
    ScanResult,
    ScanTarget,
    Tracked,
    read_allowed,
    scan,
    track,
)
from supervisor.watch.settle import Outcome, Outcomes, moved_by_plan, note_failure, settle
from supervisor.watch.steady import mark_of

Results = dict[ProcKey, tuple[Observation, tuple[Finding, ...]]]
Matchers = dict[tuple[ProcessKind, ...], RoleMatcher]

log = logging.getLogger("placement_supervisor.checker")


def _policy_of(config: Config) -> Policy:
    return Policy.of(config.drift)


def _roles_of(config: Config) -> tuple[tuple[ThreadRole, ...], Matchers]:
    all_roles = (*config.threads, *DEFAULT_THREAD_ROLES)
    kinds = (role_kinds("engine", False), role_kinds(0, False), role_kinds(0, True))
    return all_roles, {k: RoleMatcher(k, all_roles) for k in kinds}


class CheckLoop:
    """The check loop of one daemon; `run()` is its long-running task.

    `check_once` and `rebind` may be called from the API while `run` loops: a
    lock keeps passes from overlapping (the scanners are not thread-safe).
    """

    def __init__(
        self,
        *,
        store: StateStore,
        plan: PlanInForce,
        fs: HostFS,
        executor: Executor,
        supervised: Callable[[], Iterable[Supervised]],
        stopping: asyncio.Event,
        applier: Applier,
        irqs: IrqKeeperLike | None = None,
        cgroups: CgroupsLike | None = None,
        read_topology: Callable[[Topology], Topology] | None = None,
        membership_every: int = 1,
    ) -> None:
        self.store = store
        self.plan = plan
        self.fs = fs
        self.executor = executor
        self.supervised = supervised
        self.stopping = stopping
        self.irqs = irqs
        self.cgroups = cgroups
        # Each rank's cgroup.procs read every this many checks (bind.cgroup).
        self.membership_every = membership_every
        self.applier = applier  # the one bind path (watch.apply), the root's
        self.binder = applier.binder
        self.record = Recorder(store, log)
        # read_topology: what a cpuset change can change, re-read (blocking); None: no re-plan.
        self.replanning = (
            None
            if read_topology is None
            else Replanning(read_topology, plan=plan, executor=executor, record=self.record)
        )
        self.tracked: dict[ProcKey, Tracked] = {}
        self.down_reported: set[ProcKey] = set()
        self.allowed: AllowedSet = allowed_of(plan.topology)
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()  # the fast watch saw a change: check now
        self._pass_cpus = frozenset[int]()  # the main thread's affinity as the last pass began
        self.watch_state = WatchState()  # what the live watch thread saw
        self.allowed_trust = AllowedTrust()  # when a pass may skip reading the allowed set
        self.can_migrate_other = self.binder.can_migrate_other()
        self._errors: dict[str, str | None] = {}  # what -> the last error said
        self.cpuset_cache = CpusetCache()  # the passes' (under the lock) only

    # Drift policy, interval, roles: the plan holder's config in force, read at each use.
    @property
    def drift(self) -> DriftConfig:
        return self.plan.config.drift

    @property
    def policy(self) -> Policy:
        return self.plan.derived(_policy_of)

    @property
    def stale_after_s(self) -> float:
        """/healthz turns 503 when no check finished for this long: a few missed
        intervals, but never less than a slow numa_maps pass needs."""
        return max(30.0, 5 * self.policy.check_interval_s, 2 * self.drift.numa_maps_interval_s)

    # -- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        """Check every `check_interval_s` (of the config in force at each pass) until stopped."""
        if not self.can_migrate_other:
            log.info(
                "no CAP_SYS_NICE %s",
                format_fields(
                    effect="migrate_pages only for same-uid processes and unshared pages",
                    action="degrade",
                ),
            )
        self._pass_cpus = self._main_cpus()
        watch = (
            asyncio.create_task(self.watch_allowed(), name="allowed_watch")
            if self.drift.cpuset_watch_s > 0
            else None
        )
        try:
            next_at = time.monotonic()
            while not self.stopping.is_set():
                # Cleared before the pass, never after: a change the watch sees while
                # a pass runs (after its read of the allowed set) wakes the next one.
                self.wake.clear()
                try:
                    await self.check_once()
                    self._said("check", None)
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # one bad pass must not end checking
                    text = f"{type(err).__name__}: {err}"
                    if self._said("check", text):
                        self.record.error(
                            f"check failed: {text}", text, what="check", action="retry", exc=err
                        )
                next_at = max(
                    next_at + self.policy.check_interval_s, time.monotonic()
                )  # no burst after a slow pass
                try:
                    await asyncio.wait_for(self.wake.wait(), next_at - time.monotonic())
                    next_at = time.monotonic()
                except TimeoutError:
                    pass
        finally:
            if watch is not None:
                watch.cancel()

    async def watch_allowed(self) -> None:
        """Wake the full check at once when the allowed set differs from what the
        last pass started from (level-triggered: a change during a pass wakes the next).
        On the live host a plain thread (watch.cpuset_watch: inotify on the cpuset
        files, an affinity poll) does it: an event-loop wake-up cost ~2.5x a thread's.
        On a fixture tree (tests) the allowed set is read every `cpuset_watch_s`.
        """
        if self.fs.is_live:
            stop = threading.Event()
            start_watch(
                self.fs,
                self.cpuset_cache,
                asyncio.get_running_loop(),
                self.wake,
                period_s=self.drift.cpuset_watch_s,
                last_cpus=lambda: self._pass_cpus,
                stop=stop,
                state=self.watch_state,
            )
            try:
                await self.stopping.wait()
            finally:
                stop.set()
            return
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            await asyncio.sleep(self.drift.cpuset_watch_s)
            node_ids = [n.id for n in self.plan.topology.nodes]
            scope = self.plan.topology.allowed.scope
            try:
                allowed = await loop.run_in_executor(
                    self.executor, read_allowed, self.fs, node_ids, None, scope
                )
            except (SupervisorError, OSError):
                continue  # the pass reports it
            if allowed != self.allowed:
                self.wake.set()

    def _main_cpus(self) -> frozenset[int]:
        """The main thread's affinity now (what the watch compares with); empty
        on a fixture tree or when unreadable."""
        if not self.fs.is_live:
            return frozenset()
        try:
            return frozenset(os.sched_getaffinity(os.getpid()))
        except OSError:
            return frozenset()

    async def rebind(self, rank: ProcKey | None) -> dict[str, Any]:
        """POST /rebind: one enforcing pass now (every kind enforced), for one rank or all."""
        if self.stopping.is_set():
            raise SupervisorError("the supervisor is stopping")
        return await self.check_once(cause="api", only=rank)

    async def check_once(
        self, *, cause: Cause = "check", only: ProcKey | None = None
    ) -> dict[str, Any]:
        """One pass; a summary per process. `only` limits it to one process."""
        async with self.lock:
            return await self._timed_pass(cause, only, None)

    async def install(
        self, placement: Placement, topology: Topology, *, config: Config | None = None
    ) -> dict[str, Any]:
        """Put a plan made elsewhere in force (a reload's, with its `config`), run one pass
        that moves what it moved, and wake the loop: its wait is of the new interval then.
        Raises PlanError, changing nothing, when it plans other processes than run now."""
        async with self.lock:
            moved = await self._install(placement, topology, config=config)
            # The allowed set this loop compares the live one with is the plan's own:
            # a reload reads its topology before it takes the lock, so a cpuset write
            # a pass has re-planned for meanwhile would otherwise match the remembered
            # set and leave this older plan in force for good (issue 30 item 4). The
            # pass below reads the live set (trusting no earlier read) and re-plans
            # when it differs.
            self.allowed = allowed_of(topology)
            self.allowed_trust.forget()
            self.wake.set()
            return await self._timed_pass("check", None, moved)

    async def _timed_pass(
        self, cause: Cause, only: ProcKey | None, moved: Moved | None
    ) -> dict[str, Any]:
        started = time.perf_counter()
        results: Results = {}
        try:
            summary = await self._pass(cause, only, results, moved)
        finally:
            self.store.set_observations(results)  # the pass, as one snapshot
        self.store.finish_check(time.perf_counter() - started)
        return summary

    # -- one pass ---------------------------------------------------------------------

    async def _scan(
        self, targets: Sequence[ScanTarget], *, with_allowed: bool = True
    ) -> ScanResult:
        manager = self.cgroups.manager if self.cgroups is not None else None
        node_ids = [n.id for n in self.plan.topology.nodes]
        scope = self.plan.topology.allowed.scope  # attach mode: the engine's cgroup's
        placement = self.plan.placement
        result = await asyncio.get_running_loop().run_in_executor(
            self.executor,
            lambda: scan(
                self.fs,
                targets,
                node_ids=node_ids,
                irqs=self.irqs,
                cgroups=manager,
                placement=placement,
                with_allowed=with_allowed,
                cpuset_cache=self.cpuset_cache,
                membership_every=self.membership_every,
                scope=scope,
            ),
        )
        self._irq_facts()
        said = [("IRQs", result.irq_error)]
        if with_allowed:
            said.append(("allowed CPUs", result.host_error))
        for what, text in said:
            if self._said(what, text) and text is not None:
                self.record.error(
                    f"cannot observe {what}: {text}", text, what="observe", action="skip"
                )
        return result

    async def _apply(self, decisions: Sequence[Decision]) -> list[Outcomes]:
        ids = {d.key: self.tracked[d.key].id for d in decisions}
        try:
            if not any(has_work(d) for d in decisions):
                # The steady state: no write, so no round trip through the executor
                # (a worker wake-up and a loop wake-up, ~1/6 of an idle pass's CPU).
                return [Outcomes() for _ in decisions]
            return await asyncio.get_running_loop().run_in_executor(
                self.executor, self.applier.apply, decisions, ids, self.plan.placement
            )
        finally:
            self._irq_facts()

    def _irq_facts(self) -> None:
        if self.irqs is not None:
            self.record.facts(self.irqs.take_facts())

    async def _pass(
        self, cause: Cause, only: ProcKey | None, results: Results, moved: Moved | None
    ) -> dict[str, Any]:
        """Scan, decide, apply, publish. A new plan in force (`moved`, or one this pass
        installs after seeing the allowed set change) is decided here too: its moved
        processes with cause "cpuset_changed", in the same one decide per process."""
        if moved is not None:
            only = None  # a new plan moves whom it moves, whoever asked for the pass
        self._pass_cpus = self._main_cpus()  # before the scan reads the allowed set
        targets = self._targets(only, moved)
        with_allowed = self.allowed_trust.due(self.watch_state, self._pass_cpus)
        result = await self._scan(targets, with_allowed=with_allowed)
        changed = result.allowed is not None and result.allowed != self.allowed
        if changed or (self.replanning is not None and self.replanning.pending):
            if result.allowed is not None and changed:
                now_moved = await self._cpuset_changed(result.allowed)
            else:
                now_moved = await self._replan()  # the last re-plan failed: try again each pass
            if now_moved is not None:
                moved, only = now_moved, None
            targets = self._targets(only, moved)
            result = await self._scan(targets)
        policy = self.policy if cause == "check" else Policy.of(self.drift, cause)
        policies = (
            {}
            if moved is None
            else moved_policies(
                self.drift, self.plan.topology, self.store.snapshot.processes, moved
            )
        )
        now = time.monotonic()
        decisions: list[Decision] = []
        steady: dict[ProcKey, tuple[Observation, dict[str, Any]]] = {}  # see watch.steady
        slots: dict[ProcKey, Slot] = {}
        for t in targets:
            tracked = self.tracked.get(t.key)
            if tracked is None or tracked.pid != t.pid:
                continue
            if t.key in result.errors:
                self._fail_once(t.key, tracked, f"pid {t.pid}", result.errors[t.key])
                continue
            for pid, message in result.member_errors.get(t.key, ()):
                self._fail_once(t.key, tracked, f"pid {pid}", message)
            seen = result.seen.get(t.key)
            if seen is None:
                continue  # exited since the listing: its runner reports that
            if seen.memory_read:
                tracked.maps_at = now
            mark = tracked.steady  # decided nothing last time, and sees the same now: skip
            if (
                moved is None
                and mark
                and mark.holds(t.slot, policy, tracked.state, seen.observation)
            ):
                tracked.previous, steady[t.key] = seen.observation, (seen.observation, mark.summary)
                continue
            slots[t.key] = t.slot
            decisions.append(self._decide(tracked, t.slot, seen, policies.get(t.key, policy), now))
        # The trees as they are now (an adoption publishes at once), not as scanned.
        trees = self.store.snapshot.trees
        decisions = [
            without_moved(d, frozenset(m.pid for m in trees.get(d.key, ()))) for d in decisions
        ]
        outcomes = await self._apply(decisions)
        if any(_einval(o) for out in outcomes for o in out.threads.values()):
            await self._recheck_allowed()
        summary: dict[str, Any] = {}
        for d, out in zip(decisions, outcomes, strict=True):
            summary[key_label(d.key)] = self._publish(
                d, out, policies.get(d.key, policy), now, results, moved=moved, slot=slots[d.key]
            )
        for key, (obs, said) in steady.items():
            results[key], summary[key_label(key)] = (obs, ()), said
            self.down_reported.discard(key)
        summary.update(self._publish_down(only, results))
        return {"reason": "api" if cause == "api" else "check", "processes": summary}

    async def _recheck_allowed(self) -> None:
        """A thread bind got EINVAL: sched_setaffinity(2) finds none of its CPUs
        in the thread's cpuset, which is what a cpuset shrink between this
        pass's read of the allowed set and its binds does. Read the allowed set
        again and, when it changed, wake the next pass now: it re-plans (the
        watch may not have seen it yet, or may be off)."""
        node_ids = [n.id for n in self.plan.topology.nodes]
        scope = self.plan.topology.allowed.scope
        try:
            allowed = await asyncio.get_running_loop().run_in_executor(
                self.executor, read_allowed, self.fs, node_ids, self.cpuset_cache, scope
            )
        except (SupervisorError, OSError):
            return  # the next pass reports it
        if allowed != self.allowed:
            log.info(
                "allowed set changed during the pass %s",
                format_fields(cpus=format_cpulist(allowed.cpus), action="replan now"),
            )
            self.wake.set()

    def _decide(
        self, tracked: Tracked, slot: Slot, seen: Seen, policy: Policy, now: float
    ) -> Decision:
        others = {
            k: t.state.last_move
            for k, t in self.tracked.items()
            if t.state.last_move is not None and k != seen.key
        }
        d = decide(slot, seen, tracked.state, policy, now, others=others)
        tracked.state = d.state
        tracked.previous = seen.observation
        for note in d.notes:
            self.record.note(
                note.kind,
                d.key,
                note.message,
                log_message=note.log_message,
                level=logging.WARNING,
                **note.fields,
            )
        return d

    def _targets(self, only: ProcKey | None, moved: Moved | None = None) -> list[ScanTarget]:
        """What to read this pass. A process a new plan moved is read afresh: its
        threads now (to bind them at once), its memory at the next pass, after the binds."""
        for key in moved.keys if moved is not None else ():
            if key in self.tracked:
                self.tracked[key].state = after_replan(self.tracked[key].state)
        made = self.cgroups.made if self.cgroups is not None else {}
        targets = track(
            self.fs,
            self.tracked,
            self.plan.derived(_roles_of)[1],
            [(k, st, self._tree_slot(k, st, slot)) for k, st, slot in self.supervised()],
            made,
            only=only,
            numa_maps_interval_s=self.drift.numa_maps_interval_s,
            numa_stat_interval_s=(NUMA_STAT_EVERY - 0.5) * self.policy.check_interval_s,
            now=time.monotonic(),
            trees=self.store.snapshot.trees,
        )
        if moved is None:
            return targets
        return [
            replace(t, cgroup=None, read_maps=False) if t.key in moved.keys else t for t in targets
        ]

    def _tree_slot(self, key: ProcKey, status: ProcessStatus, slot: Slot) -> Slot:
        """The slot the threads of `key`'s tree are checked against: an adopted
        worker's also holds the engine's roles its cpuset lets it use (see
        plan.threads.with_engine_roles; the hook decides alike)."""
        if "engine" not in role_kinds(key, status.adopted) or key == "engine":
            return slot
        # Its cpuset is its rank's only where it has one (v2); on v1 the supervisor's.
        rank_cpuset = self.cgroups is not None and self.cgroups.manager.setup.rank_cpusets
        cpuset = slot.cpus if status.cgroup is not None and rank_cpuset else self.allowed.cpus
        return with_engine_roles(
            slot, self.plan.placement.engine, self.plan.derived(_roles_of)[0], cpuset
        )

    # -- publication (on the loop) ----------------------------------------------------

    def _publish(
        self,
        d: Decision,
        out: Outcomes,
        policy: Policy,
        now: float,
        results: Results,
        *,
        moved: Moved | None = None,
        slot: Slot,
    ) -> dict[str, Any]:
        key = d.key
        tracked = self.tracked[key]
        s = settle(d, out, policy, now, can_migrate_other=self.can_migrate_other)
        tracked.state = s.state
        if moved is not None and key in moved.keys:
            status = self.store.snapshot.processes[key]
            by_plan = moved_by_plan(
                self._tree_slot(key, status, moved.slot(key, old=True)),
                self._tree_slot(key, status, moved.slot(key)),
                d.observation,
                d.binds,
            )
            record_settled(self.record, d, s, out, moved=True, by_plan=by_plan)
        else:
            record_settled(self.record, d, s, out)
        results[key] = (s.observation, s.remaining)
        self.down_reported.discard(key)
        summary = summary_of(tracked.pid, d, s)
        tracked.steady = mark_of(d, s, slot, policy, summary)
        return summary

    def _publish_down(self, only: ProcKey | None, results: Results) -> dict[str, Any]:
        if self.stopping.is_set():
            return {}
        return publish_down(self.record, self.supervised(), self.down_reported, only, results)

    def _fail_once(self, key: ProcKey, tracked: Tracked, what: str, message: str) -> None:
        tracked.state, new = note_failure(tracked.state, "process", what, "error")
        if new:
            self.record.bind_failed(key, "process", "error", message, what=what)

    def _said(self, what: str, text: str | None) -> bool:
        """Remember the last error of `what`; True when `text` is news."""
        news = text != self._errors.get(what)
        self._errors[what] = text
        return news

    # -- a new plan: installed here, decided by the pass ------------------------------

    async def _cpuset_changed(self, new: AllowedSet) -> Moved | None:
        old, self.allowed = self.allowed, new
        enforce = self.drift.policy.get("cpuset_changed", "observe") == "enforce"
        self.record.cpuset_changed(
            old.cpus, old.mems, new.cpus, new.mems, "replan" if enforce else "observe"
        )
        return await self._replan() if enforce else None

    async def _replan(self) -> Moved | None:
        if self.replanning is None:
            return None
        result = await self.replanning.replan(self.allowed)
        if result is None:
            return None
        # The plan is for the allowed set its re-read found (a later write may have
        # landed since the scan's read): the next pass compares with that one.
        self.allowed = allowed_of(result.topology)
        moved = await self._install(result.placement, result.topology)
        self.replanning.replanned(result, moved)
        return moved

    async def _install(
        self, placement: Placement, topology: Topology, *, config: Config | None = None
    ) -> Moved:
        """The one step that puts a plan in force: the holder (and the API's view of
        it), the IRQs, then the instance and moved processes' cgroups. Returns what
        moved, with the processes whose cgroup kept its old set."""
        loop = asyncio.get_running_loop()
        moved = self.plan.install(placement, topology, config=config)
        self.store.update(placement=placement, topology=topology)
        if self.irqs is not None:
            try:
                await loop.run_in_executor(self.executor, self.irqs.apply, placement)
            except Exception as irq_err:  # IRQs degrade alone
                text = f"IRQ re-plan failed: {irq_err}"
                self.record.bind_failed(None, "irq", "error", text, action="degrade")
            self._irq_facts()
        failed = await loop.run_in_executor(
            self.executor,
            self.applier.update_cgroups,
            self.allowed,
            slots_by_key(placement),
            moved.keys,
        )
        per_key: dict[ProcKey, KernelError] = {}
        for key, err in failed:
            if key is None:
                text = f"instance cgroup update failed: {err}"
                self.record.bind_failed(None, "cgroup", "error", text, action="degrade")
                continue
            per_key[key] = err
            if key in self.tracked:
                tr = self.tracked[key]
                tr.state, new = note_failure(tr.state, "cgroup", "cgroup", err.reason)
                if new:
                    self.record.bind_failed(key, "cgroup", err.reason, str(err), what="cgroup")
        return replace(moved, cgroup_failed=MappingProxyType(per_key))


def _einval(outcome: Outcome) -> bool:
    """A thread bind the kernel refused with EINVAL (errors.Invalid)."""
    return outcome.error is not None and outcome.error.reason == "invalid"
