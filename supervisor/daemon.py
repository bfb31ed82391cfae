"""The supervising daemon: the one composition root (does I/O: processes, signals, sockets).

`run_command(args)` loads the config, discovers the host, plans, then runs
the event loop (uvloop): the engine first (until its readiness probe passes),
then one worker per rank, each spawned through the exec shim so it is bound
from its first instruction, each in its own process group, each restarted by
the policy of `supervisor.run.restart`. Every state change is an Event in the
`StateStore`, which the API and metrics read. SIGTERM/SIGINT only set a flag;
the shutdown that follows stops workers first, then the engine.
Over 500 lines because it is the root: it builds every collaborator and runs
the ordered start and shutdown; each collaborator itself lives in its folder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Protocol

from supervisor.bind.fdlimit import FdLimit, raise_fd_limit
from supervisor.config import (
    Config,
    check_listen,
    discovery_options,
    load_config,
    read_token_file,
)
from supervisor.errors import ConfigError, SupervisorError
from supervisor.events import Recorder
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields, setup_logging
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Placement
from supervisor.plan.planner import plan
from supervisor.plan.render import render_plan_table
from supervisor.run import users
from supervisor.run.runner import Runner, Runtime, first_of
from supervisor.run.spec import ChildSpec, build_specs
from supervisor.serve.routes import Actions
from supervisor.serve.server import ApiServer
from supervisor.service.cgroups import ManagedCgroups, cgroups_for, instance_suffix, remove_cgroups
from supervisor.service.instance_lock import hold_instance_lock
from supervisor.service.sdnotify import Notifier, watchdog_interval_s
from supervisor.state import ProcessStatus, Snapshot, StateStore
from supervisor.topology.accelerators import CPU
from supervisor.topology.discover import read_topology, reread_cpus
from supervisor.topology.model import Topology
from supervisor.trees.adopt import Adopter, AdoptRunner
from supervisor.trees.guardian import Guardian
from supervisor.trees.keeper import TreeKeeper
from supervisor.watch.cpuset import Replanner
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


# -- the daemon -------------------------------------------------------------------


class Daemon:
    """Wires the runners, the API, systemd notification and the check loop."""

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
    ) -> None:
        self.config = config
        self.placement = placement
        self.topology = topology
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
        self.trees: TreeKeeper | None = None
        self.adopt_executor: ThreadPoolExecutor | None = None  # binds of adoptions
        self.server: Server | None = None
        kind = placement.ranks[0].device.kind if placement.ranks else CPU.name
        # Who engines and workers run as, looked up once: a typo is exit 2.
        self.accounts = users.resolve_accounts(config)
        specs = self.specs_for(placement, sys.executable)
        initial = Snapshot(
            placement=placement,
            topology=topology,
            processes=MappingProxyType({s.key: ProcessStatus(s.key) for s in specs}),
            started_at=time.time(),
            accelerator_kind=kind,
            config_path=config.path,
            local_memory_threshold=config.drift.local_memory_threshold,
            ready_timeout_s=None if config.ready is None else config.ready.timeout_s,
        )
        self.store = StateStore(initial)
        self.specs = specs
        self.fs = fs if fs is not None else HostFS("/")
        self.cgroups = cgroups
        # The devices' IRQs (supervisor.watch.irqs): applied while the ranks start, put
        # back after they stop. The check loop observes and enforces through it;
        # what the keeper saw or did is recorded here, on the loop.
        self.irq_keeper = IrqKeeper(self.fs, placement, config.irq)
        self.recorder = Recorder(self.store, log)
        self.irq_task: asyncio.Task[None] | None = None
        self.runners: list[Runner] = []
        self.rt: Runtime | None = None
        self.signals_received = 0
        self.failed = False  # a supervision task died: the daemon exits 1
        self.actions = DaemonActions(self)  # the API's
        self._ready_sent = False
        self._last_status = ""
        self._was_ready = False

    # -- pieces for the API and the check loop ------------------------------

    def replace_placement(self, placement: Placement, topology: Topology) -> None:
        """Swap in a new plan (the check loop's re-plan after a cpuset change).

        Each runner's next spawn uses its new slot; the API shows the plan at once.
        """
        self.placement = placement
        self.topology = topology
        self.specs = self.specs_for(placement, self.runtime.python)
        by_key = {spec.key: spec for spec in self.specs}
        for r in self.runners:
            r.spec = by_key[r.key]
        self.store.update(placement=placement, topology=topology)

    def specs_for(self, placement: Placement, python: str) -> list[ChildSpec]:
        """The child specs of `placement`, each with its account (engine's, workers')
        and that account's HOME/USER/LOGNAME in its environment."""
        out: list[ChildSpec] = []
        for spec in build_specs(self.config, placement, self.env, python):
            account = self.accounts.get("engine" if spec.key == "engine" else "workers")
            if account is None:
                out.append(spec)
            else:
                out.append(replace(spec, account=account, env={**spec.env, **account.env()}))
        return out

    def runner(self, key: ProcKey) -> Runner:
        for r in self.runners:
            if r.key == key:
                return r
        raise KeyError(key)

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
            self.config,
            self.store,
            self.fs,
            executor,
            cgroups=self.cgroups,
            on_state_change=self._publish_status,
        )
        installed: list[signal.Signals] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
            installed.append(signum)
        watchdog: asyncio.Task[None] | None = None
        try:
            self.checker = self._check_loop(self.rt)
            await self._start_api(self.checker.stale_after_s)
            self.runners, adopter = self._make_runners()
            self._start_trees(adopter)
            self.irq_task = asyncio.create_task(self._apply_irqs(), name="irq_apply")
            engine = next((r for r in self.runners if r.key == "engine"), None)
            for r in self.runners:
                if engine is not None and r is not engine:
                    r.gate = engine
            for r in self.runners:
                r.task = asyncio.create_task(r.run(), name=f"runner-{r.label}")
            interval = watchdog_interval_s(self.env, os.getpid())
            if interval is not None:
                watchdog = asyncio.create_task(self._watchdog_loop(interval), name="watchdog")
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
                self._notify_ready()
            await self._wait_stop()
        finally:
            await self._shutdown()
            if watchdog is not None:
                watchdog.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watchdog
            for signum in installed:
                loop.remove_signal_handler(signum)
            executor.shutdown(wait=False, cancel_futures=True)
            if self.adopt_executor is not None:
                self.adopt_executor.shutdown(wait=False, cancel_futures=True)
            self.notifier.close()
        return 1 if self.failed else 0

    def _start_trees(self, adopter: Adopter | None) -> None:
        """The guardian (first: it must outlive us), then the tree keeper."""
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
        self.trees = TreeKeeper(
            self.fs,
            self.store,
            interval_s=self.config.drift.check_interval_s,
            cgroup_dir=self._cgroup_dir,
            direct_children=self._direct_children,
            guardian=self.guardian,
            use_connector=os.geteuid() == 0 and self.env.get(PROC_EVENTS_ENV) != "0",
            subreaper=self.subreaper,
            adopter=adopter,
            on_refresh=None if adopter is None else adopter.note_pass,
        )
        self.rt.trees = self.trees
        self.trees.start()

    def _make_runners(self) -> tuple[list[Runner], Adopter | None]:
        """One runner per process; with engine-spawned workers, the adopter that
        names them for the tree keeper."""
        assert self.rt is not None
        workers = self.config.workers
        if workers.spawned_by != "engine":
            return [Runner(self.rt, spec) for spec in self.specs], None
        nodes = [n.id for n in self.topology.nodes]
        self.adopt_executor = ThreadPoolExecutor(1, thread_name_prefix="ps-adopt")
        runners: list[Runner] = []
        adopters: dict[int, AdoptRunner] = {}
        for spec in self.specs:
            if spec.key == "engine":
                runners.append(Runner(self.rt, spec))
            else:
                adopters[spec.key] = AdoptRunner(self.rt, spec, nodes, self.adopt_executor)
                runners.append(adopters[spec.key])
        adopter = Adopter(self.rt, adopters, workers, self.placement, engine=self.config.engine)
        return runners, adopter

    def _cgroup_dir(self, key: ProcKey) -> str | None:
        return None if self.cgroups is None else self.cgroups.cpuset_dir(key)

    def _direct_children(self) -> list[int]:
        pids = [r.child.pid for r in self.runners if r.child is not None]
        if self.guardian is not None:
            pids.append(self.guardian.pid)
        return pids

    async def _start_api(self, stale_after_s: float) -> None:
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
        assert self.rt is not None
        await first_of(
            self.rt.stopping.wait(), asyncio.gather(*(r.launched.wait() for r in self.runners))
        )

    async def _wait_stop(self) -> None:
        assert self.rt is not None
        stop = asyncio.ensure_future(self.rt.stopping.wait())
        tasks = {r.task for r in self.runners if r.task is not None}
        waits: set[asyncio.Future[Any]] = {stop, *tasks}
        try:
            while not stop.done():
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is stop:
                        continue
                    waits.discard(task)
                    # A runner only returns when stopping; anything else is a bug:
                    # log it and stop everything rather than run unsupervised.
                    if task.cancelled() or task.exception() is not None:
                        exc = None if task.cancelled() else task.exception()
                        self.recorder.note(
                            "error", None, f"supervision task died: {exc!r}",
                            log_message="runner died", level=logging.ERROR,
                            error=repr(exc), action="shutdown",
                        )  # fmt: skip
                        self.failed = True  # exit 1: systemd's Restart=on-failure applies
                        self.rt.stopping.set()
        finally:
            stop.cancel()

    def status_line(self) -> str:
        """systemd's STATUS=: "2/3 running; failed: rank 1; not ready" and the like.

        Says which processes are down for good (failed, or stopped by their
        policy), what the engine's probe is waiting for, and whether the whole
        is ready (every process running and bound: what /readyz answers).
        """
        snap = self.store.snapshot
        procs = snap.processes
        running = sum(1 for p in procs.values() if p.state == "running")
        parts = [f"{running}/{len(procs)} running"]
        parts += [r.waiting for r in self.runners if r.waiting]
        for state in ("failed", "stopped"):
            down = [
                f"rank {k}" if k != "engine" else k for k, p in procs.items() if p.state == state
            ]
            if down:
                parts.append(f"{state}: {', '.join(down)}")
        parts.append("ready" if snap.ready else "not ready")
        return "; ".join(parts)

    def _publish_status(self) -> None:
        """systemd STATUS= whenever the summary changes; a log line when some
        process is down for good, or when everything first becomes ready."""
        status = self.status_line()
        if status == self._last_status:
            return
        self._last_status = status
        self.notifier.status(status)
        snap = self.store.snapshot
        if any(p.state == "failed" for p in snap.processes.values()):
            log.warning("degraded %s", format_fields(status=status, action="stay up"))
        elif snap.ready and not self._was_ready:
            log.info("ready %s", format_fields(status=status))
        self._was_ready = snap.ready

    def _notify_ready(self) -> None:
        """READY=1: the API listens and every process is spawned and bound (or
        waits for the engine); the engine's own readiness follows in STATUS=."""
        status = self.status_line()
        self._ready_sent = True
        self._last_status = status
        self._was_ready = self.store.snapshot.ready
        self.notifier.ready(status)
        self.recorder.note(
            "ready", None, f"supervisor started: {status}", log_message="supervisor started",
            status=status, pid=os.getpid(),
        )  # fmt: skip

    async def _watchdog_loop(self, interval_s: float) -> None:
        """WATCHDOG=1 every interval while the loop runs and every runner is alive."""
        while True:
            if all(r.task is None or not r.task.done() for r in self.runners) or (
                self.rt is not None and self.rt.stopping.is_set()
            ):
                self.notifier.watchdog()
            await asyncio.sleep(interval_s)

    def _check_loop(self, rt: Runtime) -> CheckLoop:
        """The check loop with exactly the collaborators it uses."""
        fs = self.fs
        return CheckLoop(
            store=self.store,
            fs=fs,
            executor=rt.executor,
            drift=self.config.drift,
            roles=self.config.threads,
            supervised=lambda: [(r.key, r.status, r.spec.slot) for r in self.runners],
            stopping=rt.stopping,
            irqs=self.irq_keeper,
            cgroups=self.cgroups,
            replanner=Replanner(
                lambda old: reread_cpus(fs, old), self.config.placement, self.replace_placement
            ),
        )

    async def _run_check_loop(self, checker: CheckLoop) -> None:
        try:
            await checker.run()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the check loop failing must not take the workers down
            self.recorder.error(
                f"check loop died: {err!r}", repr(err), what="check loop",
                action="continue unchecked", exc=err,
            )  # fmt: skip

    async def _apply_irqs(self) -> None:
        """The devices' IRQs onto their ranks' irq CPUs (blocking writes: the executor)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.runtime.executor, self.irq_keeper.apply)
        except Exception as err:  # IRQs degrade alone, never the workers
            self.recorder.error(
                f"IRQ binding failed: {err!r}", repr(err), what="irq apply",
                action="continue without", exc=err,
            )  # fmt: skip
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
        self.store.update(stopping=True)
        self.notifier.stopping("stopping: workers first, then the engine")
        self.recorder.note(
            "stopping", None, "supervisor stopping", log_message="stopping",
            processes=len(self.runners), action="stop workers",
        )  # fmt: skip
        if self.check_task is not None:
            self.check_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.check_task
        workers = [r for r in self.runners if r.key != "engine"]
        engine = [r for r in self.runners if r.key == "engine"]
        await asyncio.gather(*(r.shutdown() for r in workers), return_exceptions=True)
        await asyncio.gather(*(r.shutdown() for r in engine), return_exceptions=True)
        if self.trees is not None:
            # Whatever is left of any tree (a setsid grandchild, an orphan) ends
            # now, so that no process outlives us and every cgroup can go.
            for r in engine + workers:
                await self.trees.end_tree(r.key, self.config.stop_timeout_s)
            await self.trees.stop()
        await self._restore_irqs()
        if self.cgroups is not None:
            await asyncio.get_running_loop().run_in_executor(
                self.runtime.executor, remove_cgroups, self.cgroups, [r.key for r in self.runners]
            )
        if self.guardian is not None:
            self.guardian.close()  # a clean stop: it exits without killing
        if self.server is not None:
            await self.server.stop()
        log.info("stopped %s", format_fields(status=self.status_line()))

    # -- actions (API) ---------------------------------------------------------

    async def restart_rank(self, key: ProcKey) -> dict[str, Any]:
        if self.rt is None or self.rt.stopping.is_set():
            raise SupervisorError("the supervisor is stopping")
        runner = self.runner(key)
        old = runner.status
        runner.request_restart()
        self.recorder.note(
            "restart_requested", key, f"{key_label(key)}: restart requested",
            log_message="restart requested", previous_state=old.state, action="restart",
        )  # fmt: skip
        return {"rank": key_label(key), "previous_state": old.state, "previous_pid": old.pid}


class DaemonActions:
    """The API's changing calls, done on the daemon (implements supervisor.serve.routes.Actions)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    async def rebind(self, rank: ProcKey | None) -> dict[str, Any]:
        """One enforcing pass of the check loop now (the one rebind path)."""
        if rank is not None:
            self.daemon.runner(rank)  # KeyError -> 404
        checker = self.daemon.checker
        if checker is None:
            raise SupervisorError("the supervisor is not running")
        return await checker.rebind(rank)

    async def restart(self, rank: ProcKey) -> dict[str, Any]:
        return await self.daemon.restart_rank(rank)


# -- the command -------------------------------------------------------------------


def prepare(config: Config, env: Mapping[str, str], fs: HostFS) -> tuple[Topology, Placement]:
    """Discover and plan; log the plan table and its warnings."""
    topology = read_topology(fs, discovery_options(config, env))
    placement = plan(topology, config.placement)
    for line in render_plan_table(placement, topology).splitlines():
        log.info("plan %s", line)
    # The table ends with the plan's warnings; discovery's come here.
    for warning in topology.warnings:
        log.warning("topology warning %s", format_fields(message=warning))
    return topology, placement


def run_command(args: argparse.Namespace) -> int:
    """`placement-supervisor run --config FILE [--listen ...]`; returns the exit code.

    User errors (bad config: 2; unusable topology or infeasible plan: 3) are
    raised as `SupervisorError` for cli.py to print once and exit with.
    """
    env = dict(os.environ)
    setup_logging(env)
    if not getattr(args, "config", None):
        raise ConfigError("run: --config FILE is required")
    config = load_config(args.config)
    listen = getattr(args, "listen", None)
    if listen is not None:
        check_listen("--listen", listen)
    if config.api.token_file is not None:
        read_token_file(config.api.token_file)  # a bad token file stops us before any spawn
    _log_fd_limit(raise_fd_limit())  # before the API sizes its cap from it
    # Before any cgroup or process is touched: a second daemon of this config
    # (whatever its --listen) would share them. Held until this returns (the
    # kernel drops it at exit, however this process ends).
    lock = hold_instance_lock(instance_suffix(config, env), env, f"{config.path}")
    fs = HostFS("/")
    topology, placement = prepare(config, env, fs)
    daemon = Daemon(
        config,
        topology,
        placement,
        listen=listen,
        env=env,
        fs=fs,
        cgroups=cgroups_for(config, fs, env),
        check_loop=True,
        subreaper=True,
    )
    log.info(
        "starting %s",
        format_fields(
            config=config.path, pid=os.getpid(), processes=len(daemon.specs), action="spawn"
        ),
    )
    with lock:
        return run_loop(daemon.run())


def _log_fd_limit(limit: FdLimit) -> None:
    """One line at start: the soft RLIMIT_NOFILE the daemon runs with, and whence."""
    log.info(
        "fd limit %s",
        format_fields(
            soft_before=limit.soft_before,
            soft=limit.soft,
            hard=limit.hard,
            error=limit.error,
            action="raise" if limit.soft != limit.soft_before else "keep",
        ),
    )


def run_loop(main: Awaitable[int]) -> int:
    """Run `main` on a uvloop event loop (asyncio's own where uvloop is missing)."""
    factory: Callable[[], asyncio.AbstractEventLoop] = (
        asyncio.new_event_loop if new_uvloop is None else new_uvloop
    )
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_as_coroutine(main))


async def _as_coroutine(main: Awaitable[int]) -> int:
    return await main
