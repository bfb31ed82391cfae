"""Adoption: which rank an engine-spawned process is (`rank_from`), and its rank's runner.

The sources themselves (`parse_rank_source`, `resolve_rank`) are pure and
live in `supervisor.engines.rank_source`. `read_proc_facts` reads
/proc/<pid>/{environ,cmdline,fd} through HostFS.
`AdoptRunner` stands where a spawning `Runner` would for a rank of
`[workers] spawned_by = "engine"`: it waits (state `waiting`) for the
engine's tree to show a process its sources name, then adopts it: the pure
`watch.adoption.decide_adoption` says what to do (join the rank's cgroups,
every thread onto the rank's CPUs, pages onto its nodes) and the one
`watch.apply.Applier` does it, identity checks included; it becomes the rank's
pid, so the check loop checks, re-binds and migrates it like a spawned worker.
When it exits the rank waits for the next one; the engine, not the supervisor,
restarts workers. `AdoptingFleet` is the daemon's fleet of such ranks and the
engine (supervisor.run.fleet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from supervisor.config import ProcessConfig
from supervisor.engines.kind_rules import rules_for
from supervisor.engines.naming import Verdict, decide_rank, waiting_warnings
from supervisor.engines.rank_source import ProcFacts, RankSource, bdf_ranks, rank_tables
from supervisor.errors import KernelError
from supervisor.events import Recorder
from supervisor.hostfs import HostFS
from supervisor.in_force import PlanInForce
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Placement, Slot
from supervisor.procfs.files import list_tids, read_cmdline, read_environ
from supervisor.procfs.identity import ProcessId, ThreadId, read_thread_start
from supervisor.procfs.numa_maps import read_task_policy
from supervisor.run.fleet import RunnerFleet, plan_keys
from supervisor.run.procs import first_of
from supervisor.run.runner import Runner, Runtime
from supervisor.run.spec import SpecOf
from supervisor.state import MemPolicyStep, StateStore
from supervisor.topology.device_minors import device_rank_by_number, read_char_devices
from supervisor.trees.tree import Member, ReadFailures
from supervisor.watch.adoption import Adoptee, AdoptResult, adoption_result, decide_adoption
from supervisor.watch.apply import Applier

log = logging.getLogger("placement_supervisor.adopt")

UNNAMED_AFTER_PASSES = 30


# -- reading a process ---------------------------------------------------------------------


def read_proc_facts(
    fs: HostFS, pid: int, *, env_names: Collection[str], want_fds: bool
) -> ProcFacts | None:
    """The head of a process's command line, the variables `env_names` of its
    environment and (with `want_fds`) its open device files; None if gone.
    Raises KernelError when a file is there but cannot be read."""
    cmdline = read_cmdline(fs, pid)
    if cmdline is None:
        return None
    environ = read_environ(fs, pid, env_names) if env_names else {}
    if environ is None:
        return None
    files: list[str] = []
    numbers: list[tuple[int, int]] = []
    if want_fds:
        try:
            names = fs.listdir(f"proc/{pid}/fd")
        except OSError:
            names = []
        for name in names:
            target = fs.readlink(f"proc/{pid}/fd/{name}")
            if target is not None and target.startswith("/dev/"):
                files.append(target)
                number = fs.char_device(f"proc/{pid}/fd/{name}")
                if number is not None:
                    numbers.append(number)
    return ProcFacts(environ, cmdline, tuple(files), tuple(numbers))


# -- binding an adopted process ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    """A process offered to a rank: who it is, and its parent when offered."""

    id: ProcessId
    ppid: int

    @property
    def pid(self) -> int:
        return self.id.pid


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@contextlib.contextmanager
def exit_of(fs: HostFS, ident: ProcessId) -> Iterator[tuple[asyncio.Future[None], bool]]:
    """A future done once `ident` exits (its pidfd turns readable), and whether
    there is a pidfd: without one (Linux < 5.3) the caller looks itself."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()
    fd = ident.open_pidfd(fs)
    if fd is not None:
        loop.add_reader(fd, _set_done, exited)
    try:
        yield exited, fd is not None
    finally:
        if fd is not None:
            loop.remove_reader(fd)
            os.close(fd)


def read_adoptees(fs: HostFS, candidate: Candidate, pids: Sequence[int]) -> list[Adoptee]:
    """The candidate (first) and each of `pids` still running, with their threads'
    start times: what the Applier checks before each write. Blocking."""
    out: list[Adoptee] = []
    for pid in pids:
        ident = candidate.id if pid == candidate.pid else ProcessId.read(fs, pid)
        if ident is None:
            continue  # exited meanwhile
        try:
            tids = list_tids(fs, pid)
        except OSError:
            tids = []
        threads = ((tid, read_thread_start(fs, pid, tid)) for tid in tids)
        out.append(Adoptee(ident, tuple(ThreadId(t, ts) for t, ts in threads if ts is not None)))
    return out


def adopt_process(  # noqa: PLR0917 - one call site, run in the executor
    fs: HostFS,
    applier: Applier,
    key: ProcKey,
    candidate: Candidate,
    pids: Sequence[int],
    slot: Slot,
    all_nodes: Sequence[int],
    join: bool,
) -> AdoptResult:
    """Read the candidate (`pids`: it, then its descendants), decide its adoption
    (pure) and carry it out through the Applier. Blocking (the executor)."""
    if not candidate.id.is_running(fs):
        return AdoptResult(True, (), (), 0)
    adoptees = read_adoptees(fs, candidate, pids)
    decision = decide_adoption(key, adoptees, slot, all_nodes, join=join)
    (out,) = applier.apply([decision], {key: candidate.id})
    return adoption_result(decision, out, len(adoptees))


# -- the rank's runner ------------------------------------------------------------------


class AdoptRunner(Runner):
    """A rank whose worker the engine spawns: adopt, watch, wait for the next one."""

    def __init__(  # noqa: PLR0917 - made in one place, AdoptingFleet
        self,
        rt: Runtime,
        key: ProcKey,
        spec_of: SpecOf,
        all_nodes: Sequence[int],
        applier: Applier,
        executor: Executor | None = None,
        *,
        names: Callable[[int], int | None],
    ) -> None:
        super().__init__(rt, key, spec_of)
        # The binds of an adoption run here: a thread of their own (the daemon's
        # pool may be busy with a check pass) keeps fork-to-bound short.
        self.bind_executor = executor if executor is not None else rt.executor
        self.offers: asyncio.Queue[Candidate] = asyncio.Queue()
        self.adopted: Candidate | None = None
        self.at_stop: Candidate | None = None
        self.seen: set[ProcessId] = set()  # adopted before (an offer may come twice)
        self.cgroup_dirs: tuple[str, ...] = ()
        self.all_nodes = tuple(all_nodes)
        self.applier = applier
        self.recorder = Recorder(rt.store, log)  # its lines under this module's logger
        self.names = names  # the rank the sources give a pid now (the Adopter's `resolve`)

    def offer(self, candidate: Candidate) -> None:
        """A process the sources named this rank. Queued even while the rank
        has a live worker: an engine starts the next one as soon as it sees the
        old one die, often before we do."""
        if candidate.id not in self.seen:
            self.offers.put_nowait(candidate)

    async def run(self) -> None:
        try:
            if self.gate is not None and not await self._wait_gate():
                return
            await self._adopt_loop()
        finally:
            if self.stopping:  # the worker at the stop, which the stop does not end itself
                self.at_stop = self.adopted
            self.adopted = None
            if self.stopping:
                self.set_status(state="stopped", pid=None, ppid=None, adopted=False)

    async def _prepare_cgroup(self) -> None:
        if self.rt.cgroups is None or self.cgroup_dirs:
            return
        loop = asyncio.get_running_loop()
        try:
            self.cgroup_dirs = await loop.run_in_executor(
                self.rt.executor, self.rt.cgroups.create, self.key, self.spec.slot
            )
        except (KernelError, OSError) as err:
            self.record_bind_failure("cgroup", "error", str(err))

    async def _adopt_loop(self) -> None:
        await self._prepare_cgroup()
        self.set_status(state="waiting", pid=None, ppid=None, adopted=False)
        while not self.stopping:
            get = asyncio.ensure_future(self.offers.get())
            await first_of(get, self.rt.stopping.wait())
            if not get.done():
                get.cancel()
                return
            candidate = get.result()
            if candidate.id in self.seen or not await self._adopt(candidate):
                continue
            await self._watch(candidate)
            if self.stopping:
                return
            self.adopted = None
            self.set_status(state="waiting", pid=None, ppid=None, adopted=False, bound=False)

    def still_a_candidate(self, candidate: Candidate) -> bool:
        """Re-checked when a queued candidate's turn comes (it may have waited
        while the rank had a worker): still alive with its start time, still
        the engine's (not the child of a worker adopted since, which inherited
        its LOCAL_RANK), and still named this rank by the sources."""
        if not candidate.id.is_running(self.rt.fs):
            return False
        trees = self.rt.trees
        if trees is not None and trees.owner_of(candidate.pid) != "engine":
            return False
        return self.names(candidate.pid) == self.key

    async def _adopt(self, candidate: Candidate) -> bool:
        if not self.still_a_candidate(candidate):
            return False
        loop = asyncio.get_running_loop()
        trees = self.rt.trees
        pids = [candidate.pid]
        if trees is not None:
            pids += trees.descendants(candidate.pid)
        slot = self.spec.slot
        self.adopted = candidate
        if trees is not None:
            # Before the cgroup move: the check loop must not bind it as the
            # engine's once it sits in the rank's cpuset (EINVAL).
            trees.leaving(pids)
        result = await loop.run_in_executor(
            self.bind_executor,
            adopt_process,
            self.rt.fs,
            self.applier,
            self.key,
            candidate,
            pids,
            slot,
            self.all_nodes,
            bool(self.cgroup_dirs),
        )
        if result.gone:
            self.adopted = None
            return False  # gone before we got to it
        if not candidate.id.is_running(self.rt.fs):
            self.adopted = None
            return False  # exited while it was bound: never `running`
        self.seen.add(candidate.id)
        if trees is not None:
            trees.set_root(self.key, candidate.pid, candidate.id, adopted=True)
        for target, reason, message in result.errors:
            self.record_bind_failure(target, reason, message)
        bound = not result.errors and result.cpus == tuple(sorted(slot.cpus))
        # A /proc read: on the bind executor, as the adoption itself, not the loop.
        mempolicy = await loop.run_in_executor(
            self.bind_executor, adopted_mempolicy, self.rt.fs, candidate.pid, slot
        )
        self.set_status(
            mempolicy=mempolicy,
            state="running",
            pid=candidate.pid,
            id=candidate.id,
            ppid=candidate.ppid,
            adopted=True,
            cgroup=self.cgroup_dirs[0] if self.cgroup_dirs else None,
            bound=bound,
            cpus_bound=result.cpus == tuple(sorted(slot.cpus)),
        )
        self.ready.set()
        self.settled.set()
        self.recorder.adopted(
            self.key,
            pid=candidate.pid,
            ppid=candidate.ppid,
            cpus=result.cpus,
            cgroup=self.cgroup_dirs[0] if self.cgroup_dirs else None,
            moved=result.moved,
            bound=bound,
        )
        return True

    async def _watch(self, candidate: Candidate) -> None:
        """Until the adopted process exits (or the daemon stops)."""
        with exit_of(self.rt.fs, candidate.id) as (exited, has_pidfd):
            while not exited.done() and not self.stopping and candidate.id.is_running(self.rt.fs):
                # Its pidfd wakes us when it exits; without one (Linux < 5.3) look
                # each second. Not a 1 s timer per rank either way: eight ranks
                # made 24 tasks a second on the loop for nothing.
                poll = () if has_pidfd else (asyncio.sleep(1.0),)
                await first_of(exited, self.rt.stopping.wait(), self.interrupt.wait(), *poll)
                if self.restart_requested:
                    # The engine restarts its workers: ending this one is the restart.
                    # Until it exits it is on its way out: not ready.
                    self.restart_requested = False
                    self.interrupt.clear()
                    self.set_status(state="stopping")
                    with contextlib.suppress(OSError):
                        os.kill(candidate.pid, signal.SIGTERM)
                if not candidate.id.is_running(self.rt.fs):
                    break
        if self.stopping:
            return
        trees = self.rt.trees
        if trees is not None:
            trees.clear_root(self.key)
        self.recorder.note(
            "exit",
            self.key,
            f"{self.label}: adopted pid {candidate.pid} exited; waiting for the next",
            log_message="adopted exit",
            pid=candidate.pid,
            action="wait for the engine's next",
        )

    async def shutdown(self) -> None:
        """Stop waiting. The worker itself ends with its engine's tree (the daemon ends it)."""
        self.request_stop()
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


# -- naming the engine's processes ---------------------------------------------------------


class Adopter:
    """Names the engine tree's processes (`rank_from`, else the engine kind's rules,
    the device they hold open winning over both) and offers each to its rank.

    Called by the tree keeper for each engine-owned process when it appears
    (fork), changes (exec, comm: setproctitle sets comm too) and at each
    pass while still unnamed. A process no source names stays the engine's;
    it is counted once in `unnamed_processes` when UNNAMED_AFTER_PASSES passes
    found it so (30 s at 1 s checks: an engine titles its workers after its
    imports, seconds after they start, and they are not "unnamed" meanwhile),
    when the kind expects it to be a rank. A rank still waiting
    `waiting_warning_s` after the engine's tree appeared, while it shows such
    processes (or titled ones) and none matched, gets one WARNING.
    """

    def __init__(
        self,
        *,
        fs: HostFS,
        store: StateStore,
        stopping: asyncio.Event,
        runners: Mapping[int, AdoptRunner],
        workers: ProcessConfig,
        placement: Placement,
        engine: ProcessConfig | None = None,
    ) -> None:
        self.fs = fs
        self.store = store
        self.stopping = stopping
        # The fleet's rank runners, filled as the fleet makes them (each asks
        # `resolve`, and this offers to each: the one cycle, through a mapping).
        self.runners = runners
        self.sources: tuple[RankSource, ...] = workers.rank_from
        self.kind = None if engine is None else engine.kind
        self.local_ranks, self.device_ranks = rank_tables(placement)
        self.number_ranks = device_rank_by_number(read_char_devices(fs), bdf_ranks(placement))
        self._use_rules(None if engine is None else (engine.command, engine.env))
        self.read_failures = ReadFailures(store, log)
        self.recorder = Recorder(store, log)
        self.named: set[ProcessId] = set()
        self.unnamed_passes: dict[ProcessId, int] = {}
        self.verdicts: dict[int, Verdict] = {}  # pid -> the last verdict (the warning's titles)
        self.disagreed: set[int] = set()  # pids whose title and device disagreed (told once)
        self.waiting_warning_s = workers.waiting_warning_s
        self.tree_since: float | None = None  # monotonic: the engine's tree first seen
        self.warned: set[int] = set()  # ranks warned about while they wait

    def _use_rules(self, engine: tuple[Sequence[str], Mapping[str, str]] | None) -> None:
        """The kind's rules for the engine command line and environment `engine`."""
        rules = None
        if engine is not None and self.kind is not None:
            rules = rules_for(self.kind, *engine)
        self.rules = None if rules is None or rules.kind == "custom" else rules
        self.want_fds = any(s.kind == "device" for s in self.sources) or (
            self.rules is not None and self.rules.want_fds
        )
        self.env_names = frozenset(s.name for s in self.sources if s.kind == "env") | (
            frozenset() if self.rules is None else self.rules.env_names
        )

    def engine_found(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        """Attach mode: the engine is the process found, not a configured command;
        its rules come from its own command line and environment (vLLM's
        `-tp 2` says its engine core is no rank; its title prefix variable)."""
        try:
            self._use_rules((argv, env))
        except ValueError as err:  # a flag that is not an integer: the kind's defaults
            log.warning("engine flags unreadable error=%r action=use the kind's defaults", str(err))
            self._use_rules(((), env))

    def __call__(self, member: Member) -> None:
        """Name `member` now and offer it to its rank (on the loop: two small
        /proc reads; a hop to a busy pool thread was most of the latency)."""
        if self.stopping.is_set():
            return
        rank = self.resolve(member.pid)
        if rank is None:
            return
        self.named.add(member.id)
        runner = self.runners.get(rank)
        if runner is not None:
            runner.offer(Candidate(member.id, member.ppid))

    def resolve(self, pid: int) -> int | None:
        """The rank the sources give `pid` now (None: unnamed, or gone)."""
        try:
            facts = read_proc_facts(self.fs, pid, env_names=self.env_names, want_fds=self.want_fds)
        except KernelError as err:
            self.read_failures.note(pid, err)
            return None
        if facts is None:
            return None
        verdict = decide_rank(
            self.sources,
            self.rules,
            facts,
            local_ranks=self.local_ranks,
            device_ranks=self.device_ranks,
            number_ranks=self.number_ranks,
        )
        self.verdicts[pid] = verdict
        if verdict.disagreed and pid not in self.disagreed:
            self.disagreed.add(pid)
            self.recorder.note(
                "rank_conflict",
                verdict.rank,
                f"pid {pid} {verdict.title!r}: {verdict.rule} names rank "
                f"{verdict.title_rank}, its device names rank {verdict.rank}; the device wins",
                log_message="rank conflict",
                level=logging.WARNING,
                pid=pid,
                title=verdict.title,
                rule=verdict.rule,
                title_rank=verdict.title_rank,
                device_rank=verdict.rank,
                action="device wins",
            )
        return verdict.rank

    def note_pass(self, members: Mapping[int, Member]) -> None:
        """After each tree pass: try the unnamed again; count the long unnamed once;
        warn about ranks that wait while the tree shows processes none matched."""
        live: set[ProcessId] = set()
        for m in members.values():
            if m.owner != "engine":
                continue
            ident = m.id
            live.add(ident)
            if ident in self.named:
                continue
            self(m)
            passes = self.unnamed_passes.get(ident, 0) + 1
            self.unnamed_passes[ident] = passes
            verdict = self.verdicts.get(m.pid)
            expected = verdict is None or verdict.expected or self.rules is None
            if passes == UNNAMED_AFTER_PASSES and expected:
                self.recorder.unnamed(ident)
        self.named &= live
        for ident in list(self.unnamed_passes):
            if ident not in live:
                del self.unnamed_passes[ident]
        pids = {ident.pid for ident in live}
        for pid in [p for p in self.verdicts if p not in pids]:
            del self.verdicts[pid]
        self.disagreed &= pids
        self._warn_waiting(live)

    def _warn_waiting(self, live: set[ProcessId]) -> None:
        if not live:
            self.tree_since = None  # no engine tree (stopped, restarting): the clock restarts
            return
        now = time.monotonic()
        if self.tree_since is None:
            self.tree_since = now
        waiting = {k for k, r in self.runners.items() if r.adopted is None}
        self.warned &= waiting  # adopted since: a later wait may warn again
        unnamed = [
            v
            for i, v in ((i, self.verdicts.get(i.pid)) for i in sorted(live))
            if v is not None and i not in self.named
        ]
        rules = self.rules
        # A title the kind does not know (another prefix, a renamed class) is
        # worth naming; its own non-rank processes (EngineCore with workers) are not.
        titled = {
            v.title for v in unnamed if not v.known and (rules is None or rules.titled(v.title))
        }
        rule = (
            ("rank_from = [" + ", ".join(str(s) for s in self.sources) + "]")
            if self.sources
            else ("none" if rules is None else rules.describe())
        )
        for w in waiting_warnings(
            waited_s=now - self.tree_since,
            threshold_s=self.waiting_warning_s,
            waiting=waiting,
            warned=self.warned,
            seen=unnamed,
            titled=titled,
            rule=rule,
        ):
            self.warned.add(w.rank)
            self.store.count("waiting_warnings", key_label(w.rank))
            self.recorder.note(
                "rank_waiting",
                w.rank,
                f"rank {w.rank} still waiting {w.waited_s:.0f}s after the engine started: "
                f"no process matched {w.rule}; titles seen: {', '.join(w.titles)}",
                log_message="rank waiting",
                level=logging.WARNING,
                waited_s=round(w.waited_s, 1),
                rule=w.rule,
                titles=",".join(w.titles),
                action="keep waiting",
            )


# -- the fleet ------------------------------------------------------------------------------


class AdoptingFleet(RunnerFleet):
    """The engine, spawned by the daemon, and one `AdoptRunner` per rank, whose
    worker the engine spawns and the `Adopter` names for the tree keeper."""

    def __init__(
        self,
        rt: Runtime,
        plan: PlanInForce,
        spec_of: SpecOf,
        *,
        ranks: dict[int, AdoptRunner],
        names: Callable[[int], int | None],
        applier: Applier,
        executor: Executor,
        engine_runner: Callable[[], Runner] | None = None,
    ) -> None:
        """`ranks`: the Adopter's mapping of rank runners, filled here; `names`: its
        `resolve`; `executor`: where adoptions bind (the root's ps-adopt thread)."""
        nodes = [n.id for n in plan.topology.nodes]
        runners: list[Runner] = []
        for key in plan_keys(plan):
            if key == "engine":
                # Spawned, unless the caller finds it (supervisor.trees.attach).
                runners.append(
                    Runner(rt, key, spec_of) if engine_runner is None else engine_runner()
                )
            else:
                ranks[key] = AdoptRunner(rt, key, spec_of, nodes, applier, executor, names=names)
                runners.append(ranks[key])
        super().__init__(rt, plan, runners)


def adopted_mempolicy(fs: HostFS, pid: int, slot: Slot) -> MemPolicyStep | None:
    """What an adopted worker's own memory policy is, read from its numa_maps:
    "bind" when it holds MPOL_BIND to its slot's nodes (the start-up hook bound
    it before its code ran), "local" when its pages follow its CPUs (the
    engine's MPOL_LOCAL, or no policy), else None (another policy: its pages
    are watched and moved, see watch.decide's "auto")."""
    try:
        found = read_task_policy(fs, pid)
    except KernelError:
        return None
    if found is None:
        return None
    step, nodes = found
    if step == "bind":
        return "bind" if nodes == tuple(sorted(slot.mems)) else None
    return "local" if step == "local" else None
