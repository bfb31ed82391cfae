"""Config reload on SIGHUP: what a new config changes (pure: `restart_reasons`,
`process_change`, `respawn_keys`) and the task that reloads (`Reloader`; does I/O:
reads the config file and the topology, installs the new plan, restarts processes).

The signal handler only calls `Reloader.request` (an asyncio.Event); the task
reloads once per wake, so HUPs that arrive together give one reload, and a HUP
during a reload gives at most one more (the file may have changed after it was read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Protocol

from supervisor.config import (
    Config,
    discovery_options,
    load_config_digest,
    read_config_digest,
    read_token_file,
)
from supervisor.daemon.preflight import check_processes
from supervisor.daemon.status import ServiceStatus
from supervisor.engines.kind_rules import rules_for
from supervisor.engines.rank_source import bdf_ranks, rank_tables
from supervisor.errors import ConfigError, SupervisorError
from supervisor.events import Recorder
from supervisor.hostfs import HostFS
from supervisor.in_force import PlanInForce
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Placement
from supervisor.plan.planner import plan
from supervisor.plan.render import render_plan_table
from supervisor.plan.replan import changed_keys, same_processes
from supervisor.run import users
from supervisor.run.fleet import Fleet
from supervisor.run.spec import ChildSpec, PlanSpecs
from supervisor.state import ReloadResult, ReloadVerdict, StateStore
from supervisor.topology.discover import read_topology
from supervisor.topology.model import Topology
from supervisor.watch.loop import CheckLoop
from supervisor.worker import SLOT_ENV

log = logging.getLogger("placement_supervisor.reload")

# How often the config file's hash on disk is read between reloads: an edit that
# was never reloaded shows as `config.on_disk` != `config.in_force` (and the alert
# PlacementConfigNotApplied) within this long. One small file read.
CONFIG_WATCH_S = 10.0

# A process's own slot in its environment: a changed slot is re-bound in place,
# so this variable alone changing is no reason to restart (it keeps the old text).
IN_PLACE_ENV = (SLOT_ENV,)


# -- the diff (pure) --------------------------------------------------------------------


def restart_reasons(old: Config, new: Config) -> tuple[str, ...]:
    """The config keys a running daemon cannot change live, where `new` changes them:
    the API's sockets are bound once, the cgroup mode and the IRQ keeper's settings are
    chosen at start, and who spawns the workers (and how adopted ones are named) is
    the fleet's kind."""
    reasons: list[str] = []
    if old.api != new.api:
        reasons.append("[api]")
    if old.cgroup != new.cgroup:
        reasons.append("cgroup")
    if (old.engine is None) != (new.engine is None):
        reasons.append("[engine] added or removed")
    if old.workers.spawned_by != new.workers.spawned_by:
        reasons.append("workers.spawned_by")
    elif old.workers.rank_from != new.workers.rank_from:
        reasons.append("workers.rank_from")
    if old.irq != new.irq:
        reasons.append("[irq]")
    if old.drift.cpuset_watch_s != new.drift.cpuset_watch_s:
        # The fast watch's thread is started (or not) with its period at start.
        reasons.append("drift.cpuset_watch_s")
    reasons.extend(_adopter_reasons(old, new))
    return tuple(reasons)


def _adopter_reasons(old: Config, new: Config) -> list[str]:
    """What the adopter of engine-spawned workers (trees.adopt.Adopter) fixed at
    start: the engine kind's rules (and the layout they read from the engine's
    command) and the waiting warning's threshold. A change it would not apply is
    refused, never reloaded `ok` and left unapplied."""
    if old.engine is None or new.engine is None:
        return []
    reasons: list[str] = []
    if old.engine.attach != new.engine.attach:
        reasons.append("engine.attach (the engine is found or spawned by it)")
    if old.engine.kind != new.engine.kind:
        reasons.append(f"engine.kind ({old.engine.kind} -> {new.engine.kind})")
    elif old.workers.spawned_by == "engine":
        before = rules_for(old.engine.kind, old.engine.command, old.engine.env)
        after = rules_for(new.engine.kind, new.engine.command, new.engine.env)
        if before != after:
            reasons.append("engine.command (the layout its kind reads from it)")
    if old.workers.waiting_warning_s != new.workers.waiting_warning_s:
        reasons.append("workers.waiting_warning_s")
    return reasons


def process_change(old: Placement, new: Placement, *, adopted: bool = False) -> str | None:
    """Why `new` cannot replace `old` live (other processes planned), or None. With
    `adopted` also a rank given other devices or another local rank: the adopter
    names the engine's workers by tables it made from the plan at start."""
    if same_processes(old, new):
        if adopted and (rank_tables(old), bdf_ranks(old)) != (rank_tables(new), bdf_ranks(new)):
            return "the new plan gives the adopted ranks other devices or local ranks"
        return None
    before = len(old.ranks) + (old.engine is not None)
    after = len(new.ranks) + (new.engine is not None)
    return f"the new plan has {after} processes, {before} run now"


def _identity(spec: ChildSpec) -> tuple[object, ...]:
    env = tuple(sorted((k, v) for k, v in spec.env.items() if k not in IN_PLACE_ENV))
    # The birth binding: the shim sets every thread's CPUs and the memory policy
    # before the first instruction, and no syscall sets another process's memory
    # policy (set_mempolicy(2) is the caller's own): new CPUs or nodes mean a restart.
    slot = spec.slot
    birth = None if slot is None else (tuple(sorted(slot.cpus)), tuple(sorted(slot.mems)))
    return (spec.argv, env, spec.account, birth)


def respawn_keys(
    old: Mapping[ProcKey, ChildSpec],
    new: Mapping[ProcKey, ChildSpec],
    *,
    adopted: bool = False,
) -> tuple[ProcKey, ...]:
    """The processes whose command, environment, account or slot (its CPUs or memory
    nodes) differ between two spec sets (pure), in `new`'s order; new roles within
    the same CPUs are applied in place (thread affinities), no restart.
    With `adopted` (the engine spawns the workers) only the engine is ours to
    restart: its workers come back with it."""
    return tuple(
        key
        for key, spec in new.items()
        if (key == "engine" or not adopted)
        and (key not in old or _identity(old[key]) != _identity(spec))
    )


def _specs_before(d: Reloader, topology: Topology) -> Mapping[ProcKey, ChildSpec]:
    """The specs to tell the config's changes by: the config in force planned on the
    topology the reload read. A slot that moved only because the cpuset did (a write
    the check loop has not re-planned for yet) is then re-bound in place by the
    install's pass, as a cpuset re-plan would, not restarted; the specs in force
    when the old config cannot be planned there."""
    in_force = d.plan.config
    try:
        placement = plan(topology, in_force.placement)
    except SupervisorError:
        return d.specs.by_key()
    if not same_processes(d.plan.placement, placement):
        return d.specs.by_key()
    holder = PlanInForce(in_force, topology, placement)
    return PlanSpecs(holder, d.env, d.specs.python, d.specs.accounts).by_key()


@dataclass(frozen=True, slots=True)
class Reloaded:
    """What one reload did."""

    result: ReloadResult
    message: str
    moved: tuple[ProcKey, ...] = ()  # re-bound in place
    restarted: tuple[ProcKey, ...] = ()


# -- the reload task ------------------------------------------------------------------------


class TokenUser(Protocol):
    def use_token(self, token: bytes) -> None: ...


class Reloader:
    """Reloads the daemon's config file on request, one reload at a time; made with
    what a reload reads and replaces (supervisor.daemon.root builds it)."""

    def __init__(
        self,
        *,
        plan: PlanInForce,
        env: Mapping[str, str],
        fs: HostFS,
        specs: PlanSpecs,
        store: StateStore,
        recorder: Recorder,
        status: ServiceStatus,
        executor: Executor,
        stopping: asyncio.Event,
        checker: CheckLoop,
        fleet: Fleet,
        server: TokenUser | None,
    ) -> None:
        self.plan = plan
        self.env = env
        self.fs = fs
        self.specs = specs
        self.store = store
        self.recorder = recorder
        self.status = status
        self.executor = executor
        self.stopping = stopping
        self.checker = checker
        self.fleet = fleet
        self.server = server
        self.wanted = asyncio.Event()

    def request(self, signum: int) -> None:
        """SIGHUP's handler: a log line and the flag (the reload runs in `run`)."""
        log.info("reload requested %s", format_fields(signal=signum, action="reload"))
        self.wanted.set()

    async def run(self, started: asyncio.Event) -> None:
        """Reload once per wake, after the start (a HUP during it waits), until stopped.
        The root runs `watch_file` beside it."""
        stopping = self.stopping
        while not stopping.is_set():
            await self.wanted.wait()
            await started.wait()
            if stopping.is_set():
                return
            self.wanted.clear()
            await self.reload_once()

    async def reload_once(self) -> Reloaded:
        """RELOADING=1, the reload, READY=1 (whatever came of it: the daemon runs on).
        The verdict stays in the snapshot (STATUS=, /placement, the metrics) until the
        next reload."""
        d = self
        path = d.plan.config.path
        d.status.reloading(path)
        done = Reloaded("invalid", "the reload did not finish")
        try:
            done = await self._reload(path)
        finally:
            error = None if done.result == "ok" else done.message
            d.store.update(last_reload=ReloadVerdict(time.time(), done.result, error))
            await self.read_on_disk()
            d.status.reloaded()
        d.store.count("config_reloads", done.result)
        return done

    async def read_on_disk(self) -> None:
        """The config file's sha256 as it is on disk now into the snapshot (None when
        it cannot be read), in the executor."""
        d = self
        path = d.plan.config.path
        digest: str | None = None
        if path is not None:
            loop = asyncio.get_running_loop()
            try:
                digest = await loop.run_in_executor(d.executor, read_config_digest, path)
            except ConfigError:
                digest = None
        if digest != d.store.snapshot.config_on_disk_hash:
            d.store.update(config_on_disk_hash=digest)

    async def watch_file(self, interval_s: float = CONFIG_WATCH_S) -> None:
        """Read the file's hash every `interval_s` until stopped: an edit nobody
        reloaded shows beside the hash in force."""
        stopping = self.stopping
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval_s)
            if not stopping.is_set():
                await self.read_on_disk()

    async def _reload(self, path: str | None) -> Reloaded:
        d = self
        loop = asyncio.get_running_loop()
        executor = d.executor
        if path is None:
            return self._refused(None, None, ["the daemon was started without a config file"])
        try:
            config, digest = await loop.run_in_executor(executor, load_config_digest, path)
            reasons = restart_reasons(d.plan.config, config)
            if reasons:
                return self._refused(path, digest, reasons)
            # The allowed set is read where the plan in force read it (attach mode: the
            # engine's cgroup; an attach change needs a restart, restart_reasons).
            scope = d.plan.topology.allowed.scope
            options = replace(discovery_options(config, d.env), scope=scope)
            topology = await loop.run_in_executor(executor, read_topology, d.fs, options)
            placement = plan(topology, config.placement)
            adopted = config.workers.spawned_by == "engine"
            change = process_change(d.plan.placement, placement, adopted=adopted)
            if change is not None:
                return self._refused(path, digest, [change])
            accounts = users.resolve_accounts(config)
            # What `run` refuses at start (each command as its account would exec
            # it, each `python -m` module, argv + environment over E2BIG) is refused
            # here too, before any process is touched: restarting healthy ranks into
            # a command that cannot start is a crash loop the old config did not have.
            problems = await loop.run_in_executor(
                executor, check_processes, config, d.env, d.specs.python, placement
            )
            if problems:
                raise ConfigError("; ".join(problems))
            # The token file again (same path: [api] itself needs a restart): how a
            # token is rotated. Unreadable, empty or open to others: invalid, old kept.
            token = None
            if config.api.token_file is not None:
                token = await loop.run_in_executor(executor, read_token_file, config.api.token_file)
        except SupervisorError as err:  # the file, its keys, or no plan for it on this host
            d.recorder.note(
                "reload",
                None,
                f"reload failed: {err}",
                log_message="reload failed",
                level=logging.ERROR,
                config=path,
                result="invalid",
                error=str(err),
                action="keep old config",
            )
            return Reloaded("invalid", str(err))
        for line in render_plan_table(placement, topology).splitlines():
            log.info("plan %s", line)
        new_specs = PlanSpecs(
            PlanInForce(config, topology, placement), d.env, d.specs.python, accounts
        )
        respawn = respawn_keys(_specs_before(d, topology), new_specs.by_key(), adopted=adopted)
        moved = changed_keys(d.plan.placement, placement)
        # The runners, the tree keeper, the check loop and the API read the config at
        # each use from the plan holder, which `install` below replaces (restart
        # policy, stop timeout, ready probe, intervals; accounts at the next spawn,
        # the specs being rebuilt once the plan's generation moves).
        d.specs.accounts = dict(accounts)
        if d.server is not None and token is not None:
            d.server.use_token(token)
        await d.checker.install(placement, topology, config=config)
        d.store.update(
            config_hash=digest,
            local_memory_threshold=config.drift.local_memory_threshold,
            ready_timeout_s=None if config.ready is None else config.ready.timeout_s,
        )
        restarted = tuple(k for k in respawn if k in d.fleet)
        for key in restarted:
            d.fleet.request_restart(key)
        message = f"config reloaded: {len(moved)} re-bound in place, {len(restarted)} restarted"
        d.recorder.note(
            "reload",
            None,
            message,
            log_message="config reloaded",
            config=path,
            result="ok",
            sha256=digest,
            moved=",".join(key_label(k) for k in moved) or "-",
            restarted=",".join(key_label(k) for k in restarted) or "-",
            action="restart" if restarted else "rebind",
        )
        return Reloaded("ok", message, moved, restarted)

    def _refused(
        self, path: str | None, digest: str | None, reasons: list[str] | tuple[str, ...]
    ) -> Reloaded:
        text = f"needs a restart: {', '.join(reasons)}"
        self.recorder.note(
            "reload",
            None,
            f"reload refused: {text}",
            log_message="reload refused",
            level=logging.ERROR,
            config=path,
            result="refused",
            reason=text,
            sha256=digest,
            action="keep old config",
        )
        return Reloaded("refused", text)
