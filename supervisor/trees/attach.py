"""Attach mode: place an engine the supervisor did not start (does I/O: /proc, affinities).

With `[engine] attach = { unit | cgroup | match = "..." }` (docs/attach.md) the
engine runs under its operator's own unit. `AttachRunner` stands where the
engine's spawning `Runner` would: it looks for the engine (`find_engine`, once
per check interval, with a log line every WAITING_LOG_S while there is none),
records the CPU affinity of every process of its tree as found, makes it the
engine's tree root (the check loop binds its threads, the adopter names its
workers) and watches it; after it exits it looks again, and places the next
one (a new pid and start time). `AttachingFleet` is the `AdoptingFleet` with
that runner for the engine: its workers are adopted by the kind's rules.

Nothing here signals, restarts or re-parents a process: a restart request is
refused, and the stop detaches: every process of the engine's tree gets back
the affinity it had when found (one found later, its root's), then the tree
keeper forgets the trees (`release`) so that the daemon's stop ends none.
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from supervisor.bind.binder import Binder
from supervisor.config import Config
from supervisor.config_sections import AttachTarget
from supervisor.cpulist import format_cpulist
from supervisor.engines.kind_rules import ENGINE_ENV_NAMES
from supervisor.errors import KernelError, SupervisorError
from supervisor.hostfs import HostFS
from supervisor.in_force import PlanInForce
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey
from supervisor.plan.replan import slots_by_key
from supervisor.procfs.files import read_argv, read_environ
from supervisor.procfs.identity import ProcessId
from supervisor.procfs.stat import children_map, scan_procs
from supervisor.run.procs import first_of
from supervisor.run.runner import Runner, Runtime
from supervisor.run.spec import SpecOf
from supervisor.state import ProcessStatus
from supervisor.topology.cgroup import V1_CPUSET_ROOT, Cpuset, cpuset_of, parse_proc_cgroup
from supervisor.topology.cgroupns import host_lines
from supervisor.topology.model import CgroupLine, EngineScope
from supervisor.trees.adopt import (
    AdoptingFleet,
    AdoptRunner,
    Candidate,
    exit_of,
    read_adoptees,
)
from supervisor.trees.engine_visibility import (
    engine_visibility,
    visibility_difference,
    with_engine_visibility,
)
from supervisor.trees.find_engine import FoundEngine, find_engine
from supervisor.watch.adoption import decide_detach
from supervisor.watch.apply import Applier
from supervisor.watch.decide import Decision

log = logging.getLogger("placement_supervisor.attach")

# Told the found engine's argv and environment (the adopter's rules: Adopter.engine_found).
OnEngine = Callable[[Sequence[str], Mapping[str, str]], None]

WAITING_LOG_S = 30.0  # while the engine is not there: one INFO line this often
# After the start and after the engine exits, the first looks come at most this far
# apart, whatever the check interval: a node agent's child starts with its engine
# already there (two looks settle it), and a restarted engine is usually back
# within seconds. Each look walks /proc, so a long wait goes on at the interval.
FAST_LOOK_S = 1.0
FAST_LOOKS = 10


# -- what the tree looked like when found, and putting it back ----------------------


def tree_pids(fs: HostFS, root: ProcessId) -> dict[int, int]:
    """pid -> start time of `root` and every descendant by parent links now;
    empty when `root` is gone. Blocking."""
    stats = scan_procs(fs)
    if not root.matches(stats.get(root.pid)):
        return {}
    children = children_map(stats)
    out: dict[int, int] = {}
    todo = [root.pid]
    while todo:
        pid = todo.pop()
        if pid in out or pid not in stats:
            continue
        out[pid] = stats[pid].start_time
        todo.extend(children.get(pid, ()))
    return out


def read_affinities(fs: HostFS, root: ProcessId) -> dict[ProcessId, frozenset[int]]:
    """The CPU affinity of each process of the tree (its main thread's). Blocking."""
    binder = Binder(fs)
    out: dict[ProcessId, frozenset[int]] = {}
    for pid, start in tree_pids(fs, root).items():
        try:
            out[ProcessId(pid, start)] = binder.get_thread_affinity(pid)
        except KernelError:
            continue  # exited meanwhile
    return out


@dataclass(frozen=True, slots=True)
class Detached:
    processes: int  # whose threads were put back
    threads: int
    failed: int  # threads that refused (another user's, no CPU left in their cpuset)


def restore_affinities(
    fs: HostFS,
    root: ProcessId,
    before: Mapping[ProcessId, frozenset[int]],
    adopted: Mapping[ProcKey, ProcessId] | None = None,
) -> Detached:
    """Every thread of every process of the engine's tree, and of each `adopted`
    worker's tree (one orphaned by its engine's exit is no longer below the root),
    back to the affinity its process had when found; one born since gets the
    root's. Through the one Applier (identity checks included). Blocking."""
    fallback = before.get(root)
    heads: list[tuple[ProcKey, ProcessId]] = [*(adopted or {}).items(), ("engine", root)]
    taken: set[int] = set()
    decisions: list[Decision] = []
    starts: dict[ProcKey, ProcessId | None] = {}
    processes = 0
    for key, head in heads:
        pids = [p for p in tree_pids(fs, head) if p not in taken]
        taken.update(pids)
        if not pids:
            continue  # gone
        adoptees = read_adoptees(fs, Candidate(head, 0), pids)
        cpus_of = {
            a.pid: cpus for a in adoptees if (cpus := before.get(a.id, fallback)) is not None
        }
        processes += len(cpus_of)
        decisions.append(decide_detach(key, adoptees, cpus_of))
        starts[key] = head
    applier = Applier(fs, Binder(fs), None, None)
    outcomes = [o for out in applier.apply(decisions, starts) for o in out.threads.values()]
    failed = sum(1 for o in outcomes if o.error is not None)
    threads = sum(1 for o in outcomes if o.error is None and not o.gone)
    return Detached(processes, threads, failed)


# -- the engine's runner ------------------------------------------------------------------


class AttachRunner(Runner):
    """The engine, found rather than spawned; watched, never signalled."""

    def __init__(
        self,
        rt: Runtime,
        key: ProcKey,
        spec_of: SpecOf,
        target: AttachTarget,
        on_engine: OnEngine | None = None,
        *,
        planned_env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(rt, key, spec_of)
        self.target = target
        self.on_engine = on_engine  # told each found engine's command line and environment
        # The environment the plan was made with (its visibility variables).
        self.planned_env: Mapping[str, str] = planned_env or {}
        self.found: FoundEngine | None = None
        self.last: FoundEngine | None = None  # the last one found, until the next
        self.before: dict[ProcessId, frozenset[int]] = {}  # the found tree's affinities

    @property
    def waiting_text(self) -> str:
        return f"engine not running: waiting for {self.target}"

    async def run(self) -> None:
        try:
            await self._attach_loop()
        finally:
            if self.stopping:
                self.set_status(state="stopped", pid=None, ppid=None)

    async def _attach_loop(self) -> None:
        loop = asyncio.get_running_loop()
        self.set_status(state="waiting", pid=None, ppid=None, adopted=True)
        # READY=1 waits for no engine that may come much later (STATUS= says why).
        self.launched.set()
        logged_at: float | None = None
        seen: FoundEngine | None = None  # found at the last look
        looks = 0  # since the start or the last exit
        while not self.stopping:
            looks += 1
            found = await loop.run_in_executor(
                self.rt.executor, find_engine, self.rt.fs, self.target, os.getpid()
            )
            # Attached once two looks in a row find the same process: a shell
            # about to exec, or a killed engine's orphan not yet reaped, is not it.
            settled = found is not None and seen is not None and found.id == seen.id
            seen = found
            if found is None or not settled:
                self.waiting = self.waiting_text
                now = time.monotonic()
                if found is None and (logged_at is None or now - logged_at >= WAITING_LOG_S):
                    logged_at = now
                    log.info("engine waiting attach=%r action=look again", str(self.target))
                interval = self.rt.config.drift.check_interval_s
                if looks < FAST_LOOKS:
                    interval = min(interval, FAST_LOOK_S)
                await first_of(asyncio.sleep(interval), self.rt.stopping.wait())
                continue
            assert found is not None
            self.waiting = None
            logged_at = seen = None
            looks = 0
            if await self._attach(found):
                await self._watch(found)

    async def _attach(self, found: FoundEngine) -> bool:
        loop = asyncio.get_running_loop()
        before = await loop.run_in_executor(self.rt.executor, read_affinities, self.rt.fs, found.id)
        if found.id not in before:
            return False  # exited before we got to it
        if self.on_engine is not None:
            engine = await loop.run_in_executor(self.rt.executor, _engine_facts, self.rt.fs, found)
            if engine is None:
                return False  # exited meanwhile
            self.on_engine(*engine)
        visible = await loop.run_in_executor(
            self.rt.executor, engine_visibility, self.rt.fs, found.pid
        )
        if visible is not None:
            self._check_visibility(visible)
        self.found, self.last, self.before = found, found, before
        cpuset = await loop.run_in_executor(self.rt.executor, _cpuset_of_pid, self.rt.fs, found.pid)
        planned = frozenset(
            c for slot in slots_by_key(self.rt.plan.placement).values() for c in slot.cpus
        )
        outside = sorted(planned - cpuset.cpus) if cpuset is not None and cpuset.cpus else []
        if self.rt.trees is not None:
            scope = tree_cgroup_dir(found, cpuset)
            self.rt.trees.set_root(self.key, found.pid, found.id, cgroup_dir=scope)
        self.set_status(
            state="running",
            pid=found.pid,
            id=found.id,
            ppid=found.ppid,
            adopted=True,
            bound=True,
            cpus_bound=True,
        )
        self.recorder.note(
            "attached",
            self.key,
            f"engine: attached to pid {found.pid} ({self.target})",
            log_message="attached",
            pid=found.pid,
            ppid=found.ppid,
            cgroup=found.cgroup,
            processes=len(before),
            cgroup_cpus=None if cpuset is None or cpuset.cpus is None else sorted(cpuset.cpus),
            cpus_outside=outside,
            action="place",
        )
        if outside:
            # The kernel keeps each thread within its cgroup's CPUs: a slot wholly
            # outside them cannot be bound (bind_failed), a slot partly outside shrinks.
            self.recorder.note(
                "error",
                self.key,
                f"engine: the plan uses CPUs {format_cpulist(outside)} outside the engine's "
                f"cgroup {cpuset.path if cpuset else ''} (docs/attach.md)",
                log_message="engine cpuset narrower than the plan",
                level=logging.WARNING,
                cpus=format_cpulist(outside),
                action="bind within",
            )
        self.ready.set()
        return True

    def _check_visibility(self, visible: Mapping[str, str]) -> None:
        """An `error` event when the engine's visibility variables select other
        devices than the plan (made at start, from the supervisor's environment or
        the engine's then: supervisor.trees.engine_visibility)."""
        differs = visibility_difference(self.rt.plan.topology.devices, self.planned_env, visible)
        if differs is None:
            return
        self.recorder.note(
            "error",
            self.key,
            f"engine: {differs}; restart the supervisor to plan the engine's (docs/attach.md)",
            log_message="engine visibility differs from the plan",
            level=logging.WARNING,
            action="keep the plan",
        )

    async def _watch(self, found: FoundEngine) -> None:
        """Until the engine exits (its pidfd, or a look each check) or the daemon stops."""
        with exit_of(self.rt.fs, found.id) as (exited, has_pidfd):
            while not self.stopping and not exited.done() and found.id.is_running(self.rt.fs):
                poll = () if has_pidfd else (asyncio.sleep(1.0),)
                await first_of(exited, self.rt.stopping.wait(), *poll)
        if self.stopping:
            return
        self.found = None
        if self.rt.trees is not None:
            self.rt.trees.clear_root(self.key)
        self.set_status(state="waiting", pid=None, ppid=None)
        self.recorder.note(
            "exit",
            self.key,
            f"engine: attached pid {found.pid} exited; waiting for the next ({self.target})",
            log_message="attached exit",
            pid=found.pid,
            action="find the next",
        )

    async def detach(self, adopted: Mapping[ProcKey, ProcessId]) -> Detached | None:
        """Put back the affinities of the engine's tree and of the `adopted`
        workers as found (the stop's); None when no engine was ever found."""
        found = self.found or self.last
        if found is None:
            return None
        loop = asyncio.get_running_loop()
        done = await loop.run_in_executor(
            self.rt.executor, restore_affinities, self.rt.fs, found.id, self.before, adopted
        )
        self.recorder.note(
            "detached",
            self.key,
            f"engine: detached from pid {found.pid}: {done.threads} threads of "
            f"{done.processes} processes back to their affinity as found",
            log_message="detached",
            pid=found.pid,
            processes=done.processes,
            threads=done.threads,
            failed=done.failed,
            action="leave running",
        )
        return done

    async def shutdown(self) -> None:
        """Stop watching; the engine runs on (its affinities: `detach`)."""
        self.request_stop()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)


# -- the fleet -------------------------------------------------------------------------------


class AttachingFleet(AdoptingFleet):
    """An attached engine (`AttachRunner`) and one adopted rank per planned rank."""

    def __init__(
        self,
        rt: Runtime,
        plan: PlanInForce,
        spec_of: SpecOf,
        target: AttachTarget,
        *,
        ranks: dict[int, AdoptRunner],
        names: Callable[[int], int | None],
        applier: Applier,
        executor: Executor,
        on_engine: OnEngine | None = None,
        planned_env: Mapping[str, str] | None = None,
    ) -> None:
        self.attach = AttachRunner(
            rt, "engine", spec_of, target, on_engine, planned_env=planned_env
        )
        self.ranks = ranks  # filled by AdoptingFleet
        super().__init__(
            rt,
            plan,
            spec_of,
            ranks=ranks,
            names=names,
            applier=applier,
            executor=executor,
            engine_runner=lambda: self.attach,
        )

    def request_restart(self, key: ProcKey) -> ProcessStatus:
        if key not in self:
            raise KeyError(key)
        raise SupervisorError(
            "attached: the supervisor never restarts a process it did not start "
            "(restart the engine's own unit)"
        )

    async def shutdown(self) -> None:
        """Stop watching (workers, then the engine), put back the affinities, and let
        go of every tree: nothing is signalled."""
        await super().shutdown()
        workers: dict[ProcKey, ProcessId] = {
            k: r.at_stop.id for k, r in self.ranks.items() if r.at_stop is not None
        }
        try:
            await self.attach.detach(workers)
        except Exception as err:  # best effort: the stop goes on, the engine runs on
            log.exception("detach failed error=%r action=continue", err)
        trees = self.rt.trees
        if trees is not None:
            for key in self.keys:
                trees.release(key)


def _engine_facts(fs: HostFS, found: FoundEngine) -> tuple[list[str], dict[str, str]] | None:
    """The found engine's argv and the variables of its environment the kind's
    rules read; None when it is gone. An environment the kernel refuses (another
    user's, without CAP_SYS_PTRACE) reads as empty: the rules' defaults."""
    try:
        argv = read_argv(fs, found.pid)
    except KernelError:
        argv = []  # world-readable (proc(5)): a garbled tree; the kind's defaults
    if argv is None:
        return None
    try:
        env = read_environ(fs, found.pid, ENGINE_ENV_NAMES) or {}
    except KernelError:
        env = {}
    return argv, env


def tree_cgroup_dir(found: FoundEngine, cpuset: Cpuset | None) -> str | None:
    """The directory whose cgroup.procs the tree keeper may read for the engine's
    tree instead of walking the host's /proc each pass (pure): the engine's cpuset
    directory where it is the cgroup a `cgroup` or `unit` target names, or one
    below it. Every process there is the engine's (the operator named that cgroup
    as the engine's; a child is born in its parent's cgroup, cgroups(7)); it is
    only read. None for a `match` target (its cgroup may be a login session's,
    holding other processes) or a cpuset found only up the tree."""
    if found.cgroup is None or cpuset is None or not cpuset.files:
        return None
    named = found.cgroup.rstrip("/")
    if cpuset.path != named and not cpuset.path.startswith(named + "/"):
        return None
    return posixpath.dirname(cpuset.files[0])


def _cpuset_of_pid(fs: HostFS, pid: int) -> Cpuset | None:
    rel = f"proc/{pid}/cgroup"
    try:
        text = fs.read_optional(rel)
        return None if text is None else cpuset_of(fs, host_lines(fs, parse_proc_cgroup(text, rel)))
    except (SupervisorError, OSError):
        return None  # gone, or a garbled file: nothing to compare with


# -- planning within the engine's cgroup ------------------------------------------------------


def engine_cgroup_lines(fs: HostFS, target: AttachTarget, me: int) -> tuple[CgroupLine, ...] | None:
    """The cgroup lines whose cpuset confines the engine: a `cgroup` target's own
    directory (whether or not the engine runs), else the /proc/PID/cgroup of the
    engine running now (None: none runs)."""
    if target.how == "cgroup":
        v1 = fs.exists(f"{V1_CPUSET_ROOT}/cpuset.cpus")
        text = f"1:cpuset:{target.value}\n" if v1 else f"0::{target.value}\n"
        return parse_proc_cgroup(text, f"engine.attach.cgroup {target.value}")
    found = find_engine(fs, target, me)
    if found is None:
        return None
    rel = f"proc/{found.pid}/cgroup"
    lines = fs.read_optional(rel)
    return None if lines is None else host_lines(fs, parse_proc_cgroup(lines, rel))


def engine_scope(config: Config, fs: HostFS) -> EngineScope | None:
    """Attach mode, before discovery: where the plan's allowed set comes from. The
    engine's cgroup's cpuset (`engine.attach.cpus` narrowing it) where it is known
    now, for the plan and every re-plan after a change of that cpuset; else the
    supervisor's own set (narrowed the same way). The supervisor's own affinity is
    left as it is: binding the engine's threads needs them, not it, allowed the
    CPUs (sched_setaffinity(2) checks the target's cpuset), so it may run anywhere,
    e.g. a node agent's child in the shared pool while the engine's container has
    exclusive CPUs (docs/kubernetes.md). None: not attach mode. Blocking."""
    target = attach_target(config)
    if target is None:
        return None
    try:
        lines = engine_cgroup_lines(fs, target, os.getpid())
        cpuset = None if lines is None else cpuset_of(fs, lines)
    except (SupervisorError, OSError) as err:
        log.warning("engine cpuset unreadable error=%r action=plan within own", str(err))
        return EngineScope(None, target.cpus, target.devices)
    if lines is None or cpuset is None or cpuset.cpus is None:
        log.warning("engine cpuset unknown attach=%r action=plan within own", str(target))
        return EngineScope(None, target.cpus, target.devices)
    within = cpuset.cpus if target.cpus is None else cpuset.cpus & target.cpus
    fields = format_fields(
        cgroup=cpuset.path,
        engine_cpus=format_cpulist(cpuset.cpus),
        engine_mems=None if cpuset.mems is None else format_cpulist(cpuset.mems),
        attach_cpus=None if target.cpus is None else format_cpulist(target.cpus),
    )
    if not within:
        # Discovery says it again as the error that stops the start (topology.cgroup).
        log.error("engine cpuset disjoint from engine.attach.cpus %s action=refuse", fields)
    else:
        log.info("engine cpuset %s cpus=%s action=plan within", fields, format_cpulist(within))
    return EngineScope(lines, target.cpus, target.devices)


def attach_env(config: Config, env: Mapping[str, str], fs: HostFS) -> dict[str, str]:
    """The environment to plan with at start: the supervisor's `env`, with the
    attached engine's visibility variables where `env` sets none and the engine
    runs now under this root (supervisor.trees.engine_visibility). Blocking."""
    target = attach_target(config)
    if target is None:
        return dict(env)
    try:
        found = find_engine(fs, target, os.getpid())
    except (SupervisorError, OSError):
        found = None
    engine = None if found is None else engine_visibility(fs, found.pid)
    return dict(with_engine_visibility(env, engine))


def attach_target(config: Config) -> AttachTarget | None:
    """What `[engine] attach` names, or None when the engine is spawned."""
    return None if config.engine is None else config.engine.attach
