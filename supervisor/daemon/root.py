"""The supervising daemon: the one composition root (does I/O: processes, signals, sockets).

`run_command(args)` loads the config, discovers the host, plans, then runs
the event loop (uvloop): the engine first (until its readiness probe passes),
then one worker per rank, each spawned through the exec shim so it is bound
from its first instruction, each in its own process group, each restarted by
the policy of `supervisor.run.restart`. Every state change is an Event in the
`StateStore`, which the API and metrics read. The processes are a fleet
(supervisor.run.fleet: spawned, or with adopted workers, or an engine found
rather than spawned: supervisor.trees.attach), the plan they run by
the plan in force (supervisor.in_force), which only the check loop replaces.
`Daemon.run` builds every part in dependency order (`_build`: the bind path,
the guardian, the proc connector, the adopter, the tree keeper, the runtime,
the fleet, the check loop, the API, the reloader), each given what it uses by
keyword, then runs the root's tasks in one asyncio.TaskGroup (`_supervise`).
SIGTERM/SIGINT only set the shutdown trigger (an asyncio.Event that an
embedding program may pass in and set); the shutdown that follows, in the
TaskGroup's finally, stops workers first, then the engine. A second SIGTERM/
SIGINT in the real daemon exits at once (`_exit_now`). SIGHUP only asks for a
config reload (supervisor.daemon.reload).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Protocol

from supervisor.bind.binder import Binder
from supervisor.bind.capability import probe_capabilities
from supervisor.bind.cgroup import MEMBERSHIP_READ_EVERY
from supervisor.bind.irq_checkpoint import IrqCheckpoint
from supervisor.config import (
    Config,
    discovery_options,
)
from supervisor.daemon.cgroups import (
    ManagedCgroups,
    remove_cgroups,
)
from supervisor.daemon.hangup import Hangups
from supervisor.daemon.reload import Reloader
from supervisor.daemon.sdnotify import Notifier, watchdog_interval_s
from supervisor.daemon.status import ServiceStatus
from supervisor.errors import ConfigError, SupervisorError
from supervisor.events import Recorder
from supervisor.hostfs import HostFS
from supervisor.in_force import PlanInForce
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Placement
from supervisor.plan.planner import plan
from supervisor.plan.render import render_plan_table
from supervisor.run import users
from supervisor.run.fleet import Fleet, plan_keys, spawned_fleet
from supervisor.run.procs import first_of
from supervisor.run.runner import Runtime
from supervisor.run.spec import PlanSpecs
from supervisor.serve.routes import Actions
from supervisor.serve.server import ApiServer
from supervisor.state import Capability, CapabilityName, ProcessStatus, Snapshot, StateStore
from supervisor.topology.accelerators import CPU
from supervisor.topology.discover import read_topology, reread_cpus
from supervisor.topology.model import Topology
from supervisor.trees.adopt import Adopter, AdoptingFleet, AdoptRunner
from supervisor.trees.attach import AttachingFleet, attach_target, engine_scope
from supervisor.trees.guardian import Guardian
from supervisor.trees.keeper import TreeKeeper, open_events
from supervisor.trees.proc_events import ProcEvents
from supervisor.watch.apply import Applier
from supervisor.watch.irqs import IrqKeeper
from supervisor.watch.loop import CheckLoop

try:  # uvloop where it is installed; asyncio's own loop otherwise
    import uvloop as _uvloop

    new_uvloop: Callable[[], asyncio.AbstractEventLoop] | None = _uvloop.new_event_loop
except ImportError:  # tests/daemon/test_root.py runs this branch in a subprocess
    new_uvloop = None

log = logging.getLogger("placement_supervisor.daemon")

# "0": see new processes at each check only, not through the proc connector
# (the benchmark's baseline; a host that forbids netlink sockets needs nothing).
PROC_EVENTS_ENV = "PLACEMENT_SUPERVISOR_PROC_EVENTS"
EXECUTOR_THREADS = 2
# A forced exit (a second SIGTERM/SIGINT) exits 128 + the signal, as a shell
# reports a death by that signal.
FORCED_EXIT_BASE = 128


# -- seams the composition root fills ----------------------------------------------


class Server(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def use_token(self, token: bytes) -> None: ...


# -- the daemon -------------------------------------------------------------------


class Daemon:
    """Wires the fleet, the API, systemd notification and the check loop."""

    def __init__(
        self,
        config: Config,
        topology: Topology,
        placement: Placement,
        *,
        listen: str | None = None,
        env: Mapping[str, str] | None = None,
        fs: HostFS | None = None,
        cgroups: ManagedCgroups | None = None,
        notifier: Notifier | None = None,
        check_loop: bool = False,
        api: bool = True,
        guardian: bool = True,
        subreaper: bool = False,
        irq_checkpoint: IrqCheckpoint | None = None,
        capabilities: Mapping[CapabilityName, Capability] | None = None,
        config_hash: str | None = None,
        hangups: Hangups | None = None,
        shutdown_trigger: asyncio.Event | None = None,
        force_exit: bool = False,
    ) -> None:
        self.plan = PlanInForce(config, topology, placement)
        self.listen = listen
        self.env = dict(os.environ if env is None else env)
        self.notifier = notifier if notifier is not None else Notifier.from_env(self.env)
        self.check_loop = check_loop  # run the check loop (POST /rebind works either way)
        # Set by SIGTERM/SIGINT, or by the program that embeds the daemon (tests):
        # the ordered stop follows (hypercorn's `shutdown_trigger`).
        self.shutdown_trigger = (
            shutdown_trigger if shutdown_trigger is not None else asyncio.Event()
        )
        # A second SIGTERM/SIGINT exits at once (`_exit_now`): only the real
        # daemon (run_command), never a program that embeds one.
        self.force_exit = force_exit
        # Run's parts, made by `_build` in dependency order.
        self.checker: CheckLoop | None = None
        self.actions: DaemonActions | None = None  # the API's
        self.reloader: Reloader | None = None  # SIGHUP
        self.tasks: dict[str, asyncio.Task[None]] = {}  # the root's, in run's TaskGroup
        self.want_api = api
        self.want_guardian = guardian
        # A child subreaper changes the whole process: only the real daemon
        # (run_command) is one, never a program that embeds a Daemon.
        self.subreaper = subreaper
        self.guardian: Guardian | None = None
        self.trees: TreeKeeper | None = None
        self.server: Server | None = None
        kind = placement.ranks[0].device.kind if placement.ranks else CPU.name
        # Who engines and workers run as, looked up once: a typo is exit 2.
        self.specs = PlanSpecs(self.plan, self.env, sys.executable, users.resolve_accounts(config))
        self.keys = plan_keys(self.plan)
        initial = Snapshot(
            placement=placement,
            topology=topology,
            processes=MappingProxyType({k: ProcessStatus(k) for k in self.keys}),
            started_at=time.time(),
            pid=os.getpid(),
            accelerator_kind=kind,
            config_path=config.path,
            config_hash=config_hash,
            config_on_disk_hash=config_hash,  # the bytes just read; then CONFIG_WATCH_S
            local_memory_threshold=config.drift.local_memory_threshold,
            ready_timeout_s=None if config.ready is None else config.ready.timeout_s,
            capabilities=MappingProxyType(dict(capabilities or {})),
        )
        self.store = StateStore(initial)
        self.fs = fs if fs is not None else HostFS("/")
        if capabilities is None:  # embedded (tests, benchmarks): probed here, as run_command does
            cgroup_cap = Capability("cgroup", cgroups is not None, config.cgroup == "auto")
            caps = probe_capabilities(
                self.fs,
                topology.allowed.mems,
                cgroup=cgroup_cap,
                irq_wanted=config.irq.enabled,
                irqs_planned=placement.has_irqs,
            )
            self.store.update(capabilities=MappingProxyType(caps))
        self.cgroups = cgroups
        # The devices' IRQs (supervisor.watch.irqs): applied while the ranks start, put
        # back after they stop. The check loop observes and enforces through it;
        # what the keeper saw or did is recorded here, on the loop.
        self.irq_checkpoint = irq_checkpoint  # the originals on disk, for after a crash
        self.irq_keeper = IrqKeeper(self.fs, config.irq, checkpoint=irq_checkpoint)
        self.recorder = Recorder(self.store, log)
        self.fleet: Fleet | None = None
        self.adopt_executor: ThreadPoolExecutor | None = None  # adoptions' binds (ps-adopt)
        self.rt: Runtime | None = None
        self.signals_received = 0
        self.failed = False  # a supervision task died: the daemon exits 1
        self.status = ServiceStatus(
            self.store,
            self.notifier,
            self.recorder,
            lambda: self.fleet,
            lambda: self.rt is not None and self.rt.stopping.is_set(),
        )
        self.hangups = hangups  # run_command's, installed before the config read
        self.started = asyncio.Event()  # READY=1 sent: a reload may run

    @property
    def config(self) -> Config:
        """The config in force (a reload replaces it)."""
        return self.plan.config

    @property
    def placement(self) -> Placement:
        """The placement in force."""
        return self.plan.placement

    @property
    def runtime(self) -> Runtime:
        assert self.rt is not None, "the daemon is not running"
        return self.rt

    def _on_signal(self, signum: int) -> None:
        # Only set the trigger: the shutdown itself runs in `run()`. A second
        # SIGTERM/SIGINT is someone who will not wait for the ordered stop.
        self.signals_received += 1
        if self.signals_received > 1 and self.force_exit:
            self._exit_now(signum)
        self.shutdown_trigger.set()

    def _exit_now(self, signum: int) -> None:
        """The forced exit: one log line, then `os._exit`. What the ordered stop
        would have ended ends all the same: each direct child has PR_SET_PDEATHSIG
        =KILL (the shim's prctl(2)), and the guardian, seeing its pipe close, kills
        the trees' processes, removes the cgroups and puts the IRQs back
        (supervisor.trees.guardian); the kernel drops the instance lock."""
        log.error(
            "forced exit %s",
            format_fields(
                signal=signal.Signals(signum).name,
                children=len(self.fleet.child_pids()) if self.fleet is not None else 0,
                exit_code=FORCED_EXIT_BASE + signum,
                action="exit now, the kernel and the guardian kill what is left",
            ),
        )
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):  # a broken stream must not hold the exit
                handler.flush()
        os._exit(FORCED_EXIT_BASE + signum)

    # -- the main coroutine ----------------------------------------------------

    async def run(self) -> int:
        """Build the parts, run the root's tasks in one TaskGroup until the shutdown
        trigger fires (or a supervision dies), then the ordered stop in its finally."""
        loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(EXECUTOR_THREADS, thread_name_prefix="ps-proc")
        installed: list[signal.Signals] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
            installed.append(signum)
        # A HUP (systemctl reload, kill -HUP, a closed terminal's to our group) is a
        # reload, never a death; the children, in their own sessions, never see it.
        # Until the reloader is attached (once built), each HUP is noted (`early`).
        hangups = self.hangups if self.hangups is not None else Hangups().install()
        try:
            async with asyncio.TaskGroup() as group:
                try:
                    await self._build(executor)
                    await self._supervise(group, hangups)
                finally:
                    # The ordered stop, while the watchdog still pings; then the
                    # root's tasks left (the TaskGroup awaits them).
                    await self._shutdown()
                    for task in self.tasks.values():
                        task.cancel()
        except BaseExceptionGroup as errors:
            # One error out, as before the TaskGroup: a ConfigError stays exit 2.
            raise errors.exceptions[0] from None
        finally:
            for signum in installed:
                loop.remove_signal_handler(signum)
            hangups.detach()  # still the handler: a HUP now is noted, never a death
            executor.shutdown(wait=False, cancel_futures=True)
            if self.adopt_executor is not None:
                self.adopt_executor.shutdown(wait=False, cancel_futures=True)
            if self.fleet is not None:
                self.fleet.close()
            self.notifier.close()
        return 1 if self.failed else 0

    async def _build(self, executor: ThreadPoolExecutor) -> None:
        """Every part in dependency order, each given what it uses by keyword."""
        stopping = asyncio.Event()  # the stop under way: every part's flag
        # One bind path (watch.apply) for the check loop and the adoptions.
        applier = Applier(self.fs, Binder(self.fs), self.irq_keeper, self.cgroups)
        self.guardian = self._start_guardian()  # first: it must outlive us
        events, events_how = (
            open_events(self.fs)
            if os.geteuid() == 0 and self.env.get(PROC_EVENTS_ENV) != "0"
            else (None, None)
        )
        # Forks reach the keeper as events: the check loop reads each rank's
        # cgroup.procs every few checks only, and the keeper's quiet pass takes
        # a reading that old (issue 17, item 6; bind.cgroup).
        forks_as_events = self.cgroups is not None and events is not None
        membership_every = MEMBERSHIP_READ_EVERY if forks_as_events else 1
        naming: Adopter | None = None
        ranks: dict[int, AdoptRunner] = {}  # the adopting fleet's, filled as it makes them
        if self.config.workers.spawned_by == "engine":
            naming = Adopter(
                fs=self.fs,
                store=self.store,
                stopping=stopping,
                runners=ranks,
                workers=self.config.workers,
                placement=self.plan.placement,
                engine=self.config.engine,
            )
            # The binds of adoptions run on a thread of their own (the daemon's
            # pool may be busy with a check pass): it keeps fork-to-bound short.
            self.adopt_executor = ThreadPoolExecutor(1, thread_name_prefix="ps-adopt")
        self.trees = trees = self._tree_keeper(
            naming,
            events=events,
            events_how=events_how,
            quiet_intervals=membership_every + 1 if forks_as_events else 1,
        )
        self.rt = rt = Runtime(
            self.plan,
            self.store,
            self.fs,
            executor,
            stopping=stopping,
            cgroups=self.cgroups,
            on_state_change=self.status.publish,
            trees=trees,
        )
        if naming is None or self.adopt_executor is None:
            self.fleet = fleet = spawned_fleet(rt, self.plan, self.specs)
        elif (target := attach_target(self.config)) is not None:
            # Attach mode (supervisor.trees.attach): the engine found, not spawned.
            self.fleet = fleet = AttachingFleet(
                rt,
                self.plan,
                self.specs,
                target,
                ranks=ranks,
                names=naming.resolve,
                applier=applier,
                executor=self.adopt_executor,
                on_engine=naming.engine_found,
                planned_env=self.env,
            )
        else:
            self.fleet = fleet = AdoptingFleet(
                rt,
                self.plan,
                self.specs,
                ranks=ranks,
                names=naming.resolve,
                applier=applier,
                executor=self.adopt_executor,
            )
        self.checker = checker = self._check_loop(rt, fleet, applier, membership_every)
        self.actions = DaemonActions(
            keys=self.keys,
            checker=checker,
            fleet=fleet,
            stopping=stopping,
            recorder=self.recorder,
        )
        self.server = await self._start_api(self.actions, lambda: checker.stale_after_s)
        self.reloader = Reloader(
            plan=self.plan,
            env=self.env,
            fs=self.fs,
            specs=self.specs,
            store=self.store,
            recorder=self.recorder,
            status=self.status,
            executor=executor,
            stopping=stopping,
            checker=checker,
            fleet=fleet,
            server=self.server,
        )

    async def _supervise(self, group: asyncio.TaskGroup, hangups: Hangups) -> None:
        """Start the root's tasks in `group`, then supervise until the stop."""
        rt, fleet, checker, reloader = self.runtime, self.fleet, self.checker, self.reloader
        assert fleet is not None and checker is not None and reloader is not None
        tasks = self.tasks
        assert self.trees is not None
        # The subreaper, the connector's reader, the pass task (stopped by the stop:
        # it ends what is left of each tree first).
        self.trees.start(group)
        tasks["shutdown_trigger"] = group.create_task(self._stop_on_trigger(), name="trigger")
        hangups.attach(asyncio.get_running_loop(), reloader.request)
        if hangups.early:  # the config may have changed since it was read: once more
            reloader.request(signal.SIGHUP)
        tasks["reload"] = group.create_task(reloader.run(self.started), name="reload")
        # The file's hash on disk beside the one in force, read between reloads too.
        tasks["config_watch"] = group.create_task(reloader.watch_file(), name="config_watch")
        if self.guardian is not None:
            tasks["guardian"] = group.create_task(self._watch_guardian(), name="guardian")
        tasks["irq_apply"] = irq_task = group.create_task(self._apply_irqs(), name="irq_apply")
        fleet.start()
        interval = watchdog_interval_s(self.env, os.getpid())
        if interval is not None:
            tasks["watchdog"] = group.create_task(
                self.status.watchdog_loop(interval), name="watchdog"
            )
        # The check loop starts once the IRQs are applied (its IRQ checks
        # compare against them), not once every process is up: an engine
        # can take many minutes to load a model, and its threads, the
        # workers waiting on it, and /healthz all need checking meanwhile.
        await first_of(irq_task, rt.stopping.wait())
        if not rt.stopping.is_set() and self.check_loop:
            tasks["check_loop"] = group.create_task(
                self._run_check_loop(checker), name="check_loop"
            )
        await self._wait_started()
        if not rt.stopping.is_set():
            self.status.notify_ready()
            self.started.set()
            # What start-up built (modules, config, plan, topology) lives as
            # long as the daemon: frozen, the cyclic collector stops walking
            # it at every collection, which a fork storm's short-lived
            # objects trigger many times a second (8% of a storm's cost).
            gc.freeze()
        await self._wait_stop()

    async def _stop_on_trigger(self) -> None:
        """The shutdown trigger (a signal's, or the embedding program's) starts the stop."""
        await self.shutdown_trigger.wait()
        self.runtime.stopping.set()

    async def _stop_task(self, name: str) -> None:
        task = self.tasks.pop(name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _start_guardian(self) -> Guardian | None:
        """The guardian, told the cgroups and the IRQ checkpoint before any write."""
        if not self.want_guardian:
            return None
        dirs = [] if self.cgroups is None else [self.fs.path(d) for d in self.cgroups.instance_dirs]
        guardian = Guardian.start(self.specs.python, dirs[0] if dirs else "")
        if guardian is not None:
            for path in dirs:
                guardian.cgroup(path)
            if (cp := self.irq_checkpoint) is not None:  # before the first IRQ write
                guardian.irq_checkpoint(cp.path, cp.pid)
        return guardian

    def _tree_keeper(
        self,
        naming: Adopter | None,
        *,
        events: ProcEvents | None,
        events_how: str | None,
        quiet_intervals: int,
    ) -> TreeKeeper:
        """The tree keeper; `naming` names the engine's processes (adopted workers)."""
        return TreeKeeper(
            self.fs,
            self.store,
            interval_s=lambda: self.config.drift.check_interval_s,  # the config in force
            cgroup_dir=self._cgroup_dir,
            direct_children=self._direct_children,
            # An attached engine's tree is not ours to end, not even if we die.
            guardian=None if attach_target(self.config) is not None else self.guardian,
            events=events,
            events_how=events_how,
            quiet_intervals=quiet_intervals,
            subreaper=self.subreaper,
            adopter=naming,
            on_refresh=None if naming is None else naming.note_pass,
            recent_procs=None if self.cgroups is None else self.cgroups.manager.recent_procs,
        )

    def _cgroup_dir(self, key: ProcKey) -> str | None:
        return None if self.cgroups is None else self.cgroups.cpuset_dir(key)

    def _direct_children(self) -> list[int]:
        pids = self.fleet.child_pids() if self.fleet is not None else []
        if self.guardian is not None:
            pids.append(self.guardian.pid)
        return pids

    async def _start_api(
        self, actions: Actions, stale_after_s: Callable[[], float]
    ) -> Server | None:
        if not self.want_api:
            return None
        server = ApiServer(
            self.store, actions, self.config.api, self.listen, stale_after_s=stale_after_s
        )
        try:
            await server.start()
        except SupervisorError as err:
            if err.exit_code != 1:
                raise
            # The API cannot listen (port taken, a path that is not a socket):
            # exit 2, not 1, which Restart=on-failure would retry forever.
            raise ConfigError(str(err)) from None
        return server

    async def _wait_started(self) -> None:
        """Until every runner has made its first spawn (bound, or failed to) or
        waits on the engine, or a stop. Not until the engine's probe passes: that
        may take ready.timeout_s (a 10-minute model load), longer than any start
        timeout systemd should wait; STATUS= and /readyz show it instead."""
        assert self.rt is not None and self.fleet is not None
        await first_of(self.rt.stopping.wait(), self.fleet.wait_launched())

    async def _wait_stop(self) -> None:
        assert self.fleet is not None
        await self.fleet.watch(self._supervision_died)

    def _supervision_died(self, exc: BaseException | None) -> None:
        # A runner only returns when stopping; anything else is a bug: log it
        # and stop everything rather than run unsupervised.
        self.recorder.note(
            "error",
            None,
            f"supervision task died: {exc!r}",
            log_message="runner died",
            level=logging.ERROR,
            error=repr(exc),
            action="shutdown",
        )
        self.failed = True  # exit 1: systemd's Restart=on-failure applies
        self.runtime.stopping.set()

    def _check_loop(
        self, rt: Runtime, fleet: Fleet, applier: Applier, membership_every: int
    ) -> CheckLoop:
        """The check loop with exactly the collaborators it uses."""
        fs = self.fs
        return CheckLoop(
            store=self.store,
            plan=self.plan,
            fs=fs,
            executor=rt.executor,
            supervised=fleet.supervised,
            stopping=rt.stopping,
            applier=applier,
            irqs=self.irq_keeper,
            cgroups=self.cgroups,
            read_topology=lambda old: reread_cpus(fs, old),
            membership_every=membership_every,
        )

    async def _watch_guardian(self) -> None:
        """A dead guardian is replaced within a check (trees.guardian): without one,
        a SIGKILL of the daemon would leave every setsid descendant and cgroup."""
        guardian = self.guardian
        assert guardian is not None and self.rt is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.drift.check_interval_s)  # the config in force
            old = await loop.run_in_executor(self.runtime.executor, guardian.replace_if_dead)
            if old is not None:  # logged by replace_if_dead; an event for GET /events
                text = f"guardian pid {old} died; now pid {guardian.pid}"
                self.store.emit("error", None, text, error="guardian gone")

    async def _run_check_loop(self, checker: CheckLoop) -> None:
        try:
            await checker.run()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the check loop failing must not take the workers down
            self.recorder.error(
                f"check loop died: {err!r}",
                repr(err),
                what="check loop",
                action="continue unchecked",
                exc=err,
            )

    async def _apply_irqs(self) -> None:
        """The devices' IRQs onto their ranks' irq CPUs (blocking writes: the executor)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(
                self.runtime.executor, self.irq_keeper.apply, self.plan.placement
            )
        except Exception as err:  # IRQs degrade alone, never the workers
            self.recorder.error(
                f"IRQ binding failed: {err!r}",
                repr(err),
                what="irq apply",
                action="continue without",
                exc=err,
            )
        finally:
            self.recorder.facts(self.irq_keeper.take_facts())

    async def _restore_irqs(self) -> None:
        """Original IRQ affinities back, once any apply still in flight has finished."""
        if (apply := self.tasks.pop("irq_apply", None)) is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await apply
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.runtime.executor, self.irq_keeper.restore)
        except Exception as err:  # best effort: the stop goes on
            log.exception("irq restore failed error=%r action=continue", err)
        finally:
            self.recorder.facts(self.irq_keeper.take_facts())

    async def _shutdown(self) -> None:
        """The ordered stop: workers first, then the engine, then what is left."""
        await self._stop_task("reload")  # a reload in flight ends here: the stop goes first
        await self._stop_task("config_watch")
        if self.rt is None:  # the build failed early: what it made is closed, no more
            if self.trees is not None:
                await self.trees.stop()  # the connector's socket
            if self.guardian is not None:
                self.guardian.close()  # a clean stop: it exits without killing
            return
        self.rt.stopping.set()
        self.rt.stop_started_at = time.monotonic()  # every wait from here fits stop_grace_s
        self.store.update(stopping=True)
        self.notifier.stopping("stopping: workers first, then the engine")
        self.recorder.note(
            "stopping",
            None,
            "supervisor stopping",
            log_message="stopping",
            processes=len(self.keys),
            action="stop workers",
        )
        await self._stop_task("check_loop")
        await self._stop_task("guardian")
        if self.fleet is not None:
            await self.fleet.shutdown()  # workers first, then the engine
        if self.trees is not None:
            # Whatever is left of any tree (a setsid grandchild, an orphan) ends
            # now, so that no process outlives us and every cgroup can go.
            for key in self.keys:
                await self.trees.end_tree(key, self.rt.stop_wait_s("engine"))
            await self.trees.stop()
        await self._restore_irqs()
        if self.cgroups is not None:
            await asyncio.get_running_loop().run_in_executor(
                self.runtime.executor, remove_cgroups, self.cgroups, list(self.keys)
            )
        if self.guardian is not None:
            self.guardian.close()  # a clean stop: it exits without killing
        if self.server is not None:
            await self.server.stop()
        log.info("stopped %s", format_fields(status=self.status.line()))


class DaemonActions:
    """The API's changing calls (implements supervisor.serve.routes.Actions), made
    with the parts they use."""

    def __init__(
        self,
        *,
        keys: Collection[ProcKey],
        checker: CheckLoop,
        fleet: Fleet,
        stopping: asyncio.Event,
        recorder: Recorder,
    ) -> None:
        self.keys = keys
        self.checker = checker
        self.fleet = fleet
        self.stopping = stopping
        self.recorder = recorder

    async def rebind(self, rank: ProcKey | None) -> dict[str, Any]:
        """One enforcing pass of the check loop now (the one rebind path)."""
        if rank is not None and rank not in self.keys:
            raise KeyError(rank)  # -> 404
        return await self.checker.rebind(rank)

    async def restart(self, rank: ProcKey) -> dict[str, Any]:
        if self.stopping.is_set():
            raise SupervisorError("the supervisor is stopping")
        old = self.fleet.request_restart(rank)  # KeyError -> 404
        self.recorder.note(
            "restart_requested",
            rank,
            f"{key_label(rank)}: restart requested",
            log_message="restart requested",
            previous_state=old.state,
            action="restart",
        )
        return {"rank": key_label(rank), "previous_state": old.state, "previous_pid": old.pid}


# -- the command -------------------------------------------------------------------


def prepare(config: Config, env: Mapping[str, str], fs: HostFS) -> tuple[Topology, Placement]:
    """Discover and plan; log the plan table and its warnings."""
    # Attach mode: plan within the engine's cgroup's cpuset (trees.attach.engine_scope).
    options = replace(discovery_options(config, env), scope=engine_scope(config, fs))
    topology = read_topology(fs, options)
    placement = plan(topology, config.placement)
    for line in render_plan_table(placement, topology).splitlines():
        log.info("plan %s", line)
    # The table ends with the plan's warnings; discovery's come here.
    for warning in topology.warnings:
        log.warning("topology warning %s", format_fields(message=warning))
    return topology, placement


def run_loop(main: Awaitable[int]) -> int:
    """Run `main` on a uvloop event loop (asyncio's own where uvloop is missing)."""
    factory: Callable[[], asyncio.AbstractEventLoop] = (
        asyncio.new_event_loop if new_uvloop is None else new_uvloop
    )
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_as_coroutine(main))


async def _as_coroutine(main: Awaitable[int]) -> int:
    return await main
