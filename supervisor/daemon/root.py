"""The supervising daemon: the one composition root (does I/O: processes, signals, sockets).

`run_command(args)` loads the config, discovers the host, plans, then runs
the event loop (uvloop): the engine first (until its readiness probe passes),
then one worker per rank, each spawned through the exec shim so it is bound
from its first instruction, each in its own process group, each restarted by
the policy of `supervisor.run.restart`. Every state change is an Event in the
`StateStore`, which the API and metrics read. The processes are a fleet
(supervisor.run.fleet: spawned, or with adopted workers), the plan they run by
the plan in force (supervisor.in_force), which only the check loop replaces.
SIGTERM/SIGINT only set a flag; the shutdown that follows stops workers first,
then the engine. SIGHUP only asks for a config reload (supervisor.daemon.reload).
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
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any, Protocol

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
from supervisor.trees.adopt import AdoptingFleet
from supervisor.trees.attach import attach_target, attaching_fleet, confine_to_engine
from supervisor.trees.guardian import Guardian
from supervisor.trees.keeper import TreeKeeper
from supervisor.watch.irqs import IrqKeeper
from supervisor.watch.loop import CheckLoop

try:  # uvloop where it is installed; asyncio's own loop otherwise
    import uvloop as _uvloop

    new_uvloop: Callable[[], asyncio.AbstractEventLoop] | None = _uvloop.new_event_loop
except ImportError:  # tests/test_daemon.py runs this branch in a subprocess
    new_uvloop = None

log = logging.getLogger("placement_supervisor.daemon")

# "0": see new processes at each check only, not through the proc connector
# (the benchmark's baseline; a host that forbids netlink sockets needs nothing).
PROC_EVENTS_ENV = "PLACEMENT_SUPERVISOR_PROC_EVENTS"
EXECUTOR_THREADS = 2


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
    ) -> None:
        self.plan = PlanInForce(config, topology, placement)
        self.listen = listen
        self.env = dict(os.environ if env is None else env)
        self.notifier = notifier if notifier is not None else Notifier.from_env(self.env)
        self.check_loop = check_loop  # run the check loop (POST /rebind works either way)
        self.checker: CheckLoop | None = None
        self.check_task: asyncio.Task[None] | None = None
        self.want_api = api
        self.want_guardian = guardian
        # A child subreaper changes the whole process: only the real daemon
        # (run_command) is one, never a program that embeds a Daemon.
        self.subreaper = subreaper
        self.guardian: Guardian | None = None
        self.guardian_task: asyncio.Task[None] | None = None
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
        self.irq_task: asyncio.Task[None] | None = None
        self.fleet: Fleet | None = None
        self.rt: Runtime | None = None
        self.signals_received = 0
        self.failed = False  # a supervision task died: the daemon exits 1
        self.actions = DaemonActions(self)  # the API's
        self.status = ServiceStatus(
            self.store,
            self.notifier,
            self.recorder,
            lambda: self.fleet,
            lambda: self.rt is not None and self.rt.stopping.is_set(),
        )
        self.reloader = Reloader(self)  # SIGHUP
        self.hangups: Hangups | None = None  # run_command's, installed before the config read
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
        # Only set the flag: the shutdown itself runs in `run()`.
        self.signals_received += 1
        if self.rt is not None:
            self.rt.stopping.set()

    # -- the main coroutine ----------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(EXECUTOR_THREADS, thread_name_prefix="ps-proc")
        self.rt = Runtime(
            self.plan,
            self.store,
            self.fs,
            executor,
            cgroups=self.cgroups,
            on_state_change=self.status.publish,
        )
        installed: list[signal.Signals] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
            installed.append(signum)
        # A HUP (systemctl reload, kill -HUP, a closed terminal's to our group) is a
        # reload, never a death; the children, in their own sessions, never see it.
        hangups = self.hangups if self.hangups is not None else Hangups().install()
        hangups.attach(loop, self.reloader.request)
        if hangups.early:  # the config may have changed since it was read: once more
            self.reloader.request(signal.SIGHUP)
        reload_task = asyncio.create_task(self.reloader.run(self.started), name="reload")
        watchdog: asyncio.Task[None] | None = None
        try:
            self.checker = checker = self._check_loop(self.rt)
            await self._start_api(lambda: checker.stale_after_s)  # of the config in force
            self.fleet = fleet = self._make_fleet(self.rt)
            self._start_trees(fleet)
            if self.guardian is not None:
                self.guardian_task = asyncio.create_task(self._watch_guardian(), name="guardian")
            self.irq_task = asyncio.create_task(self._apply_irqs(), name="irq_apply")
            fleet.start()
            interval = watchdog_interval_s(self.env, os.getpid())
            if interval is not None:
                watchdog = asyncio.create_task(self.status.watchdog_loop(interval), name="watchdog")
            # The check loop starts once the IRQs are applied (its IRQ checks
            # compare against them), not once every process is up: an engine
            # can take many minutes to load a model, and its threads, the
            # workers waiting on it, and /healthz all need checking meanwhile.
            await first_of(self.irq_task, self.rt.stopping.wait())
            if not self.rt.stopping.is_set() and self.check_loop:
                self.check_task = asyncio.create_task(
                    self._run_check_loop(self.checker), name="check_loop"
                )
            await self._wait_started()
            if not self.rt.stopping.is_set():
                self.status.notify_ready()
                self.started.set()
                # What start-up built (modules, config, plan, topology) lives as
                # long as the daemon: frozen, the cyclic collector stops walking
                # it at every collection, which a fork storm's short-lived
                # objects trigger many times a second (8% of a storm's cost).
                gc.freeze()
            await self._wait_stop()
        finally:
            reload_task.cancel()  # a reload in flight ends here: the stop goes first
            with contextlib.suppress(asyncio.CancelledError):
                await reload_task
            await self._shutdown()
            for task in (watchdog,) if watchdog is not None else ():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for signum in installed:
                loop.remove_signal_handler(signum)
            hangups.detach()  # still the handler: a HUP now is noted, never a death
            executor.shutdown(wait=False, cancel_futures=True)
            if self.fleet is not None:
                self.fleet.close()
            self.notifier.close()
        return 1 if self.failed else 0

    def _start_trees(self, fleet: Fleet) -> None:
        """The guardian (first: it must outlive us), then the tree keeper."""
        # Who names the engine's processes: the adopting fleet's, handed to the keeper here.
        naming = fleet.naming if isinstance(fleet, AdoptingFleet) else None
        assert self.rt is not None
        if self.want_guardian:
            dirs = (
                []
                if self.cgroups is None
                else [self.fs.path(d) for d in self.cgroups.instance_dirs]
            )
            self.guardian = Guardian.start(self.rt.python, dirs[0] if dirs else "")
            if self.guardian is not None:
                for path in dirs:
                    self.guardian.cgroup(path)
                if (cp := self.irq_checkpoint) is not None:  # before the first IRQ write
                    self.guardian.irq_checkpoint(cp.path, cp.pid)
        self.trees = TreeKeeper(
            self.fs,
            self.store,
            interval_s=lambda: self.config.drift.check_interval_s,  # the config in force
            cgroup_dir=self._cgroup_dir,
            direct_children=self._direct_children,
            # An attached engine's tree is not ours to end, not even if we die.
            guardian=None if attach_target(self.config) is not None else self.guardian,
            use_connector=os.geteuid() == 0 and self.env.get(PROC_EVENTS_ENV) != "0",
            subreaper=self.subreaper,
            adopter=naming,
            on_refresh=None if naming is None else naming.note_pass,
            recent_procs=None if self.cgroups is None else self.cgroups.manager.recent_procs,
        )
        self.rt.trees = self.trees
        self.trees.start()
        if self.cgroups is not None and self.trees.events is not None:
            # Forks reach the keeper as events: the check loop reads each rank's
            # cgroup.procs every few checks only, and the keeper's quiet pass
            # takes a reading that old (issue 17, item 6; bind.cgroup).
            self.cgroups.manager.membership_every = MEMBERSHIP_READ_EVERY
            self.trees.quiet_intervals = MEMBERSHIP_READ_EVERY + 1

    def _make_fleet(self, rt: Runtime) -> Fleet:
        """The spawned fleet; with `[workers] spawned_by = "engine"`, the adopting one."""
        # Attach mode (supervisor.trees.attach): an engine found, not spawned.
        if (attached := attaching_fleet(rt, self.plan, self.specs, self.cgroups)) is not None:
            return attached
        workers = self.config.workers
        if workers.spawned_by != "engine":
            return spawned_fleet(rt, self.plan, self.specs)
        return AdoptingFleet(
            rt, self.plan, self.specs, workers, self.cgroups, engine=self.config.engine
        )

    def _cgroup_dir(self, key: ProcKey) -> str | None:
        return None if self.cgroups is None else self.cgroups.cpuset_dir(key)

    def _direct_children(self) -> list[int]:
        pids = self.fleet.child_pids() if self.fleet is not None else []
        if self.guardian is not None:
            pids.append(self.guardian.pid)
        return pids

    async def _start_api(self, stale_after_s: Callable[[], float]) -> None:
        if not self.want_api:
            return
        actions: Actions = self.actions
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
        self.server = server

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

    def _check_loop(self, rt: Runtime) -> CheckLoop:
        """The check loop with exactly the collaborators it uses."""
        fs = self.fs
        return CheckLoop(
            store=self.store,
            plan=self.plan,
            fs=fs,
            executor=rt.executor,
            supervised=lambda: [] if self.fleet is None else self.fleet.supervised(),
            stopping=rt.stopping,
            irqs=self.irq_keeper,
            cgroups=self.cgroups,
            read_topology=lambda old: reread_cpus(fs, old),
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
        if self.irq_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.irq_task
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.runtime.executor, self.irq_keeper.restore)
        except Exception as err:  # best effort: the stop goes on
            log.exception("irq restore failed error=%r action=continue", err)
        finally:
            self.recorder.facts(self.irq_keeper.take_facts())

    async def _shutdown(self) -> None:
        assert self.rt is not None
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
        for task in (self.check_task, self.guardian_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
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

    # -- actions (API) ---------------------------------------------------------

    async def restart_rank(self, key: ProcKey) -> dict[str, Any]:
        if self.rt is None or self.rt.stopping.is_set() or self.fleet is None:
            raise SupervisorError("the supervisor is stopping")
        old = self.fleet.request_restart(key)  # KeyError -> 404
        self.recorder.note(
            "restart_requested",
            key,
            f"{key_label(key)}: restart requested",
            log_message="restart requested",
            previous_state=old.state,
            action="restart",
        )
        return {"rank": key_label(key), "previous_state": old.state, "previous_pid": old.pid}


class DaemonActions:
    """The API's changing calls, done on the daemon (implements supervisor.serve.routes.Actions)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    async def rebind(self, rank: ProcKey | None) -> dict[str, Any]:
        """One enforcing pass of the check loop now (the one rebind path)."""
        if rank is not None and rank not in self.daemon.keys:
            raise KeyError(rank)  # -> 404
        checker = self.daemon.checker
        if checker is None:
            raise SupervisorError("the supervisor is not running")
        return await checker.rebind(rank)

    async def restart(self, rank: ProcKey) -> dict[str, Any]:
        return await self.daemon.restart_rank(rank)


# -- the command -------------------------------------------------------------------


def prepare(config: Config, env: Mapping[str, str], fs: HostFS) -> tuple[Topology, Placement]:
    """Discover and plan; log the plan table and its warnings."""
    confine_to_engine(config, fs)  # attach mode: plan within the engine's cgroup (trees.attach)
    topology = read_topology(fs, discovery_options(config, env))
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
