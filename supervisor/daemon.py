"""The supervising daemon: the one composition root (does I/O: processes, signals, sockets).

`run_command(args)` loads the config, discovers the host, plans, then runs
the event loop (uvloop): the engine first (until its readiness probe passes),
then one worker per rank, each spawned through the exec shim so it is bound
from its first instruction, each in its own process group, each restarted by
the policy of `supervisor.restart`. Every state change is an Event in the
`StateStore`, which the API and metrics read. SIGTERM/SIGINT only set a flag;
the shutdown that follows stops workers first, then the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

import uvloop

from supervisor.api import Actions, ApiServer
from supervisor.bind.binder import Binder
from supervisor.bind.cgroup import CgroupManager, ProcessCgroup, detect_cgroup_setup
from supervisor.bind.report import ShimReport, ShimReportError, parse_shim_report, shim_argv
from supervisor.checker import check_loop as default_check_loop
from supervisor.config import Config, ProcessConfig, check_listen, discovery_options, load_config
from supervisor.cpulist import format_cpulist
from supervisor.errors import ConfigError, KernelError, SupervisorError
from supervisor.hostfs import HostFS
from supervisor.irqs import IrqKeeper
from supervisor.logs import format_fields, setup_logging
from supervisor.placement import Placement, RankPlacement, Slot
from supervisor.plan import plan
from supervisor.probe import describe_probe, wait_ready
from supervisor.procs import ChildProcess, read_proc_stat, read_until_eof, spawn
from supervisor.render import render_plan_table
from supervisor.restart import RestartHistory, RunOutcome, decide_restart
from supervisor.sdnotify import NOTIFY_VARS, Notifier, watchdog_interval_s
from supervisor.state import ProcessState, ProcessStatus, ProcKey, Snapshot, StateStore, key_label
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DeviceKind, Topology
from supervisor.worker import SLOT_ENV, slot_env_value

log = logging.getLogger("placement_supervisor.daemon")

INSTANCE_ENV = "PLACEMENT_SUPERVISOR_INSTANCE"
REPORT_TIMEOUT_S = 30.0  # the shim binds and execs in milliseconds; this is a hung cgroup write
EXECUTOR_THREADS = 2
# The variable that tells a worker which device(s) it drives, per kind, as in
# DeepInfer's assign_visible_devices. `cpu` stand-ins and config-named `pci`
# devices have none unless `visible_devices_env` names one.
VISIBLE_DEVICES_VAR: Mapping[DeviceKind, str] = MappingProxyType(
    {
        "nvidia": "CUDA_VISIBLE_DEVICES",
        "ascend": "ASCEND_RT_VISIBLE_DEVICES",
        "amd": "HIP_VISIBLE_DEVICES",
    }
)
# Defaults that only apply where the operator's environment (or the config)
# leaves them unset.
KIND_ENV_DEFAULTS: Mapping[DeviceKind, Mapping[str, str]] = MappingProxyType(
    {
        # CUDA numbers devices fastest-first unless told otherwise; the index
        # we pass is the PCI-order index nvidia-smi and /proc/driver use.
        "nvidia": MappingProxyType({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
    }
)


# -- what to spawn (pure) -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """Everything needed to start one supervised process, before the shim wraps it."""

    key: ProcKey
    argv: tuple[str, ...]
    env: Mapping[str, str]
    slot: Slot


def visible_devices_var(kind: DeviceKind, override: str | None) -> str | None:
    """The variable naming a rank's devices: the config's, else the kind's, else none."""
    if override:
        return override
    return VISIBLE_DEVICES_VAR.get(kind)


def command_fields(rank: RankPlacement, world_size: int) -> dict[str, object]:
    devices = rank.all_devices
    return {
        "rank": rank.rank,
        "local_rank": rank.local_rank,
        "device_index": ",".join(str(d.index) for d in devices),
        "bus_id": ",".join(d.bus_id or "" for d in devices),
        "world_size": world_size,
    }


def worker_argv(template: Sequence[str], rank: RankPlacement, world_size: int) -> tuple[str, ...]:
    """The worker command with {rank}, {local_rank}, {device_index}, {bus_id}, {world_size}."""
    fields = command_fields(rank, world_size)
    return tuple(word.format(**fields) for word in template)


def child_env(
    base: Mapping[str, str],
    defaults: Mapping[str, str],
    forced: Mapping[str, str],
    drop: Sequence[str] = (),
) -> dict[str, str]:
    """`base` (the operator's environment) + `defaults` where unset + `forced`, minus `drop`.

    Defaults use set-if-unset semantics (the seed's HCCL timeouts: an
    operator who tuned HCCL_CONNECT_TIMEOUT for the cluster keeps the value);
    `forced` is what only the supervisor can know (the slot, the device).
    """
    env = {k: v for k, v in base.items() if k not in drop and k not in NOTIFY_VARS}
    for name, value in defaults.items():
        env.setdefault(name, value)
    env.update(forced)
    return env


PYTHON_NAMES = ("python", "python3")


def resolve_python(argv: Sequence[str], python: str) -> tuple[str, ...]:
    """A command whose first word is exactly `python` or `python3` runs under
    the supervisor's own interpreter (pure).

    The demo and most engine configs say `python -m ...` and mean the
    environment the supervisor is installed in; a systemd unit's PATH would
    otherwise find the system interpreter. Any other word, or a path, is kept.
    """
    if argv and argv[0] in PYTHON_NAMES:
        return (python, *argv[1:])
    return tuple(argv)


def build_specs(
    config: Config,
    placement: Placement,
    base_env: Mapping[str, str],
    python: str = sys.executable,
) -> list[ChildSpec]:
    """The engine (when planned) then one spec per rank, in rank order."""
    specs: list[ChildSpec] = []
    if config.engine is not None and placement.engine is not None:
        slot = placement.engine
        env = child_env(
            base_env,
            config.engine.env,
            {SLOT_ENV: slot_env_value("engine", slot.to_doc())},
        )
        specs.append(ChildSpec("engine", resolve_python(config.engine.command, python), env, slot))
    world_size = len(placement.ranks)
    for rank in placement.ranks:
        spec = _rank_spec(config.workers, config, rank, world_size, base_env)
        specs.append(replace(spec, argv=resolve_python(spec.argv, python)))
    return specs


def _rank_spec(
    workers: ProcessConfig,
    config: Config,
    rank: RankPlacement,
    world_size: int,
    base_env: Mapping[str, str],
) -> ChildSpec:
    kind = rank.device.kind
    forced = {SLOT_ENV: slot_env_value(rank.rank, rank.slot.to_doc())}
    drop: list[str] = []
    var = visible_devices_var(kind, config.visible_devices_env)
    if var is not None:
        forced[var] = ",".join(str(d.index) for d in rank.all_devices)
        if kind == "amd" and var == "HIP_VISIBLE_DEVICES":
            # HIP indexes into what ROCR_VISIBLE_DEVICES leaves; our index is
            # over all devices, so the operator's ROCR filter must not apply.
            drop.append("ROCR_VISIBLE_DEVICES")
    defaults = dict(KIND_ENV_DEFAULTS.get(kind, {}))
    defaults.update(workers.env)
    env = child_env(base_env, defaults, forced, drop)
    return ChildSpec(rank.rank, worker_argv(workers.command, rank, world_size), env, rank.slot)


_ERRNO_NAME = re.compile(r"\bE[A-Z]{2,}\b")
_REASON_BY_ERRNO = {
    "ESRCH": "gone",
    "ENOENT": "gone",
    "EPERM": "denied",
    "EACCES": "denied",
    "EROFS": "denied",
    "EINVAL": "invalid",
}


def failure_reason(text: str) -> str:
    """The metric `reason` of a shim failure text ("... EINVAL (...)") (pure)."""
    match = _ERRNO_NAME.search(text)
    return _REASON_BY_ERRNO.get(match.group(0), "error") if match else "error"


def bound_as_planned(report: ShimReport, slot: Slot) -> bool:
    """True when the kernel read back exactly the planned CPUs and an MPOL_BIND to the mems."""
    return (
        report.affinity_error is None
        and tuple(report.cpus) == tuple(sorted(slot.cpus))
        and report.mempolicy == "bind"
        and tuple(report.mems) == tuple(sorted(slot.mems))
        and not report.cgroup_errors
    )


# -- seams the composition root fills ----------------------------------------------


class ProcessCgroups(Protocol):
    """Per-process cgroups (`supervisor.bind.cgroup`): directories the shim joins."""

    def create(self, key: ProcKey, slot: Slot) -> tuple[str, ...]: ...

    def remove(self, key: ProcKey) -> None: ...

    def close(self) -> None: ...


class Server(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


CheckLoop = Callable[["Daemon"], Awaitable[None]]
"""The drift/observation loop, started after READY (`run_command` passes
supervisor.checker's; None runs without one)."""


@dataclass(slots=True)
class Runtime:
    """What the daemon's parts share: the store, the executor, the stop flag."""

    config: Config
    store: StateStore
    fs: HostFS
    executor: ThreadPoolExecutor
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    cgroups: ProcessCgroups | None = None
    python: str = sys.executable
    on_state_change: Callable[[], None] | None = None  # e.g. a new systemd STATUS=


# -- one supervised process --------------------------------------------------------


class Runner:
    """Runs one process (the engine or one rank) for the daemon's lifetime.

    Owns the child from spawn to reap: every path out of `run()` stops and
    reaps it. Restart requests and the daemon's stop arrive as `interrupt`.
    """

    def __init__(self, rt: Runtime, spec: ChildSpec) -> None:
        self.rt = rt
        self.spec = spec
        self.key = spec.key
        self.label = key_label(spec.key)
        self.child: ChildProcess | None = None
        self.history = RestartHistory()
        self.interrupt = asyncio.Event()
        self.restart_requested = False
        self.settled = asyncio.Event()  # first reached running, failed or stopped
        self.ready = asyncio.Event()  # first readiness (the engine's probe passed)
        self._watchers: list[asyncio.Future[None]] = []
        self.gate: Runner | None = None  # workers wait for the engine's first readiness
        self.task: asyncio.Task[None] | None = None
        self.report: ShimReport | None = None

    # -- state -----------------------------------------------------------

    @property
    def status(self) -> ProcessStatus:
        return self.rt.store.snapshot.processes.get(self.key) or ProcessStatus(self.key)

    def set_status(self, **changes: Any) -> ProcessStatus:
        old = self.status
        new = replace(old, **changes)
        self.rt.store.set_process(new)
        if new.state != old.state:
            self.rt.store.emit(
                "state",
                self.key,
                f"{self.label}: {old.state} -> {new.state}",
                old=old.state,
                new=new.state,
                pid=new.pid,
            )
            for watcher in self._watchers:
                if not watcher.done():
                    watcher.set_result(None)
            self._watchers.clear()
            if self.rt.on_state_change is not None:
                self.rt.on_state_change()
        if new.state in ("running", "failed", "stopped"):
            self.settled.set()
        return new

    def next_change(self) -> asyncio.Future[None]:
        """A future that resolves at this process's next state change."""
        watcher: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watchers.append(watcher)
        return watcher

    def request_restart(self) -> None:
        self.restart_requested = True
        self.interrupt.set()

    def request_stop(self) -> None:
        self.interrupt.set()

    @property
    def stopping(self) -> bool:
        return self.rt.stopping.is_set()

    # -- the loop ----------------------------------------------------------

    async def run(self) -> None:
        try:
            if self.gate is not None and not await self._wait_gate():
                return
            await self._supervise()
        finally:
            await self._reap_on_exit()

    async def _wait_gate(self) -> bool:
        """Wait for the engine's first readiness; False when stopping.

        While the engine is down for good (failed, or stopped by its policy)
        this worker shows `stopped` with an event saying why; a manual restart
        of the engine that brings it up releases the wait.
        """
        gate = self.gate
        assert gate is not None
        announced = False
        while not gate.ready.is_set():
            if self.stopping:
                return False
            engine_state = gate.status.state
            if engine_state in ("failed", "stopped") and not announced:
                announced = True
                self.set_status(state="stopped")
                self.rt.store.emit(
                    "not_started",
                    self.key,
                    f"{self.label}: not started: the engine is {engine_state}",
                    engine=engine_state,
                )
                log.warning(
                    "not started %s",
                    format_fields(rank=self.label, engine=engine_state, action="wait for engine"),
                )
            await _first_of(gate.next_change(), self.rt.stopping.wait())
        self.restart_requested = False  # a restart asked for while waiting: this is the start
        self.interrupt.clear()
        return not self.stopping

    async def _supervise(self) -> None:
        cfg = self.rt.config.restart
        while not self.stopping:
            outcome = await self._run_once()
            if self.stopping:
                return
            if self.restart_requested:
                self._manual_restart()
                continue
            decision = decide_restart(cfg, self.history, outcome)
            self.history = decision.history
            if decision.action == "restart":
                restarts = self.status.restarts + 1
                self.set_status(
                    state="backoff",
                    backoff_s=decision.delay_s,
                    next_start_at=time.time() + decision.delay_s,
                    restarts=restarts,
                    pid=None,
                )
                self.rt.store.count("restarts", self.label)
                self.rt.store.emit(
                    "restart",
                    self.key,
                    f"{self.label}: {decision.reason}; restart in {decision.delay_s:g}s",
                    delay_s=decision.delay_s,
                    reason=decision.reason,
                    restarts=restarts,
                )
                log.info(
                    "restart scheduled %s",
                    format_fields(
                        rank=self.label,
                        reason=decision.reason,
                        delay_s=f"{decision.delay_s:g}",
                        restarts=restarts,
                        action="backoff",
                    ),
                )
                if await self._wait_interrupt(decision.delay_s) and self.restart_requested:
                    self._manual_restart()
                continue
            state: ProcessState = "failed" if decision.action == "fail" else "stopped"
            self.set_status(state=state, pid=None, backoff_s=0.0, next_start_at=None)
            self.rt.store.emit(
                state, self.key, f"{self.label}: {decision.reason}", reason=decision.reason
            )
            (log.error if state == "failed" else log.info)(
                "process down %s",
                format_fields(rank=self.label, state=state, reason=decision.reason, action="hold"),
            )
            # Held down until someone restarts it by hand (or the daemon stops).
            while not self.stopping and not self.restart_requested:
                await self._wait_interrupt(None)
            if self.stopping:
                return
            self._manual_restart()

    def _manual_restart(self) -> None:
        self.restart_requested = False
        self.interrupt.clear()
        self.history = RestartHistory()
        self.rt.store.count("restarts", self.label)
        self.set_status(restarts=self.status.restarts + 1, backoff_s=0.0, next_start_at=None)

    async def _wait_interrupt(self, timeout_s: float | None) -> bool:
        """Wait for an interrupt up to `timeout_s`; True when one came."""
        try:
            await asyncio.wait_for(self.interrupt.wait(), timeout_s)
        except TimeoutError:
            return False
        self.interrupt.clear()
        return True

    async def _run_once(self) -> RunOutcome:
        started = time.monotonic()
        child = await self.spawn_child()
        if child is None:
            return RunOutcome(None, 0.0, time.monotonic())
        exit_future = child.wait()
        exec_ok = self.report is not None and not self.report.exec_failed
        if self.report is None:
            # No report: the shim failed before binding or hangs; never leave
            # an unaccounted-for process behind.
            await child.stop(self.rt.config.stop_timeout_s)
        elif exec_ok and not await self._await_ready(child, exit_future):
            # The probe gave up on a live engine: stop it and count a failed start.
            await child.stop(self.rt.config.stop_timeout_s)
        elif exec_ok:
            await _first_of(exit_future, self.interrupt.wait())
            if not exit_future.done():  # stop or restart request
                self.interrupt.clear()
                await self._stop_child(child, "restart" if self.restart_requested else "stop")
        code = await exit_future
        ended = time.monotonic()
        self.child = None
        self.set_status(exit_code=code)
        self.rt.store.emit(
            "exit",
            self.key,
            f"{self.label}: pid {child.pid} exited ({code})",
            pid=child.pid,
            exit_code=code,
            ran_s=round(ended - started, 3),
        )
        log.info(
            "exit %s",
            format_fields(
                rank=self.label, pid=child.pid, code=code, ran_s=f"{ended - started:.1f}"
            ),
        )
        return RunOutcome(code if exec_ok else None, ended - started, ended)

    async def _stop_child(self, child: ChildProcess, why: str) -> int:
        timeout_s = self.rt.config.stop_timeout_s
        log.info(
            "stopping %s",
            format_fields(rank=self.label, pid=child.pid, why=why, timeout_s=f"{timeout_s:g}"),
        )
        return await child.stop(timeout_s)

    async def _await_ready(self, child: ChildProcess, exit_future: asyncio.Future[int]) -> bool:
        """For the engine with a probe: wait until it passes; True when ready or exited."""
        probe = self.rt.config.ready if self.key == "engine" else None
        if probe is None:
            self.mark_running(child)
            return True
        probe_task = asyncio.ensure_future(wait_ready(probe, lambda: not exit_future.done()))
        await _first_of(probe_task, exit_future, self.interrupt.wait())
        if not probe_task.done():
            probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe_task
            return True  # exited, or interrupted: the caller's wait handles it
        result = probe_task.result()
        if result.ready:
            self.rt.store.emit(
                "ready",
                self.key,
                f"{self.label}: ready ({result.detail}) after {result.waited_s:.1f}s",
                waited_s=round(result.waited_s, 3),
            )
            log.info(
                "ready %s",
                format_fields(
                    rank=self.label, probe=result.detail, waited_s=f"{result.waited_s:.1f}"
                ),
            )
            self.mark_running(child)
            return True
        if exit_future.done():
            return True
        self.rt.store.emit(
            "ready_failed",
            self.key,
            f"{self.label}: readiness probe {describe_probe(probe)} failed: {result.detail}",
            detail=result.detail,
        )
        log.error(
            "ready probe failed %s",
            format_fields(
                rank=self.label, probe=describe_probe(probe), detail=result.detail, action="stop"
            ),
        )
        return False

    def mark_running(self, child: ChildProcess) -> None:
        self.set_status(state="running")
        self.ready.set()

    async def spawn_child(self) -> ChildProcess | None:
        """Spawn through the shim and read its report; None when nothing started."""
        spec = self.spec
        self.report = None
        self.set_status(state="starting", pid=None, backoff_s=0.0, next_start_at=None)
        cgroup_dirs: tuple[str, ...] = ()
        loop = asyncio.get_running_loop()
        if self.rt.cgroups is not None:
            try:
                cgroup_dirs = await loop.run_in_executor(
                    self.rt.executor, self.rt.cgroups.create, self.key, spec.slot
                )
            except (KernelError, OSError) as err:
                self.record_bind_failure("cgroup", failure_reason(str(err)), str(err))
        read_fd, write_fd = os.pipe()
        argv = shim_argv(
            self.rt.python,
            spec.slot.cpus,
            spec.slot.mems,
            spec.argv,
            cgroups=cgroup_dirs,
            report_fd=write_fd,
            parent_pid=os.getpid(),
        )
        try:
            # On the loop's thread, never a pool thread: see procs.spawn (PDEATHSIG).
            child = spawn(argv, spec.env, pass_fds=(write_fd,))
        except OSError as err:
            os.close(read_fd)
            os.close(write_fd)
            self._spawn_failed(f"cannot start {argv[0]}: {err.strerror or err}", None)
            return None
        os.close(write_fd)
        self.child = child
        data = await read_until_eof(read_fd, REPORT_TIMEOUT_S)
        stat = await loop.run_in_executor(self.rt.executor, read_proc_stat, self.rt.fs, child.pid)
        start_time = stat.start_time if stat is not None else None
        self.set_status(pid=child.pid, start_time=start_time)
        try:
            report = parse_shim_report(data)
        except ShimReportError as err:
            self.record_bind_failure("process", "error", f"no shim report: {err}")
            self._spawn_failed(f"the shim reported nothing ({err})", child.pid)
            return child
        self.report = report
        if report.exec_failed:
            self._spawn_failed(
                f"cannot execute {spec.argv[0]!r}: {report.exec_error} ({report.errno})",
                child.pid,
            )
            return child
        self._record_bind(child, report)
        return child

    def _spawn_failed(self, message: str, pid: int | None) -> None:
        self.rt.store.emit("spawn_failed", self.key, f"{self.label}: {message}", pid=pid)
        log.error(
            "spawn failed %s",
            format_fields(rank=self.label, pid=pid, error=message, action="restart policy"),
        )

    def record_bind_failure(self, target: str, reason: str, message: str) -> None:
        self.rt.store.count("bind_failures", (self.label, target, reason))
        self.rt.store.emit(
            "bind_failed",
            self.key,
            f"{self.label}: {target} bind failed: {message}",
            target=target,
            reason=reason,
        )
        log.warning(
            "bind failed %s",
            format_fields(
                rank=self.label, target=target, reason=reason, error=message, action="degrade"
            ),
        )

    def _record_bind(self, child: ChildProcess, report: ShimReport) -> None:
        slot = self.spec.slot
        if report.affinity_error:
            self.record_bind_failure(
                "process", failure_reason(report.affinity_error), report.affinity_error
            )
        if report.mempolicy != "bind":
            why = report.reason or f"mempolicy {report.mempolicy}"
            self.record_bind_failure("memory", failure_reason(why), why)
        for err in report.cgroup_errors:
            self.record_bind_failure("cgroup", failure_reason(err), err)
        bound = bound_as_planned(report, slot)
        self.set_status(
            mempolicy=report.mempolicy,
            mempolicy_reason=report.reason,
            cgroup=report.cgroups[0] if report.cgroups else None,
            bound=bound,
        )
        cpus = format_cpulist(report.cpus)
        mems = format_cpulist(report.mems)
        self.rt.store.emit(
            "spawn",
            self.key,
            f"{self.label}: pid {child.pid} cpus={cpus} mems={mems} mempolicy={report.mempolicy}",
            pid=child.pid,
            cpus=list(report.cpus),
            mems=list(report.mems),
            mempolicy=report.mempolicy,
            reason=report.reason,
            cgroups=list(report.cgroups),
            bound=bound,
        )
        log.info(
            "spawn %s",
            format_fields(
                rank=self.label,
                pid=child.pid,
                cpus=cpus,
                mems=mems,
                mempolicy=report.mempolicy,
                reason=report.reason,
                cgroup=",".join(report.cgroups) or None,
                bound=str(bound).lower(),
            ),
        )

    async def _reap_on_exit(self) -> None:
        child, self.child = self.child, None
        if child is not None and child.returncode is None:
            # Cancelled or stopping mid-run: the child never outlives its runner.
            code = await asyncio.shield(self._stop_child(child, "shutdown"))
            self.rt.store.emit(
                "exit", self.key, f"{self.label}: pid {child.pid} stopped ({code})", exit_code=code
            )
        if self.stopping:
            self.set_status(state="stopped", pid=None, backoff_s=0.0, next_start_at=None)

    async def shutdown(self) -> None:
        """Stop the child (TERM to its group, KILL after stop_timeout_s) and end `run`."""
        self.request_stop()
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


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
        cgroups: ProcessCgroups | None = None,
        notifier: Notifier | None = None,
        check_loop: CheckLoop | None = None,
        api: bool = True,
    ) -> None:
        self.config = config
        self.placement = placement
        self.topology = topology
        self.listen = listen
        self.env = dict(os.environ if env is None else env)
        self.notifier = notifier if notifier is not None else Notifier.from_env(self.env)
        self.check_loop = check_loop
        self.check_task: asyncio.Task[None] | None = None
        self.want_api = api
        self.server: Server | None = None
        kind = placement.ranks[0].device.kind if placement.ranks else "cpu"
        specs = build_specs(config, placement, self.env)
        initial = Snapshot(
            placement=placement,
            topology=topology,
            processes=MappingProxyType({s.key: ProcessStatus(s.key) for s in specs}),
            started_at=time.time(),
            accelerator_kind=kind,
            config_path=config.path,
        )
        self.store = StateStore(initial)
        self.specs = specs
        self.fs = fs if fs is not None else HostFS("/")
        self.cgroups = cgroups
        # The devices' IRQs (supervisor.irqs): applied while the ranks start, put
        # back after they stop. The check loop observes and enforces through it
        # and counts its re-writes itself (rebinds{reason="irq_affinity"}).
        self.irq_keeper = IrqKeeper(
            self.fs, self.store, topology, placement, config.irq, count_rebinds=False
        )
        self.irq_task: asyncio.Task[None] | None = None
        self.runners: list[Runner] = []
        self.rt: Runtime | None = None
        self.signals_received = 0
        self.actions = DaemonActions(self)  # the API's; the drift step may set its rebinder
        self._ready_sent = False
        self._last_status = ""

    # -- pieces for the API and the check loop ------------------------------

    def replace_placement(self, placement: Placement, topology: Topology) -> None:
        """Swap in a new plan (the check loop's re-plan after a cpuset change).

        Each runner's next spawn uses its new slot; the API shows the plan at once.
        """
        self.placement = placement
        self.topology = topology
        self.specs = build_specs(self.config, placement, self.env, self.runtime.python)
        by_key = {spec.key: spec for spec in self.specs}
        for r in self.runners:
            r.spec = by_key[r.key]
        self.store.update(placement=placement, topology=topology)

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
            await self._start_api()
            self.irq_keeper.attach_loop(loop)
            self.irq_task = asyncio.create_task(self._apply_irqs(), name="irq_apply")
            self.runners = [Runner(self.rt, spec) for spec in self.specs]
            engine = next((r for r in self.runners if r.key == "engine"), None)
            for r in self.runners:
                if engine is not None and r is not engine:
                    r.gate = engine
            for r in self.runners:
                r.task = asyncio.create_task(r.run(), name=f"runner-{r.label}")
            interval = watchdog_interval_s(self.env, os.getpid())
            if interval is not None:
                watchdog = asyncio.create_task(self._watchdog_loop(interval), name="watchdog")
            await self._wait_started()
            await _first_of(self.irq_task, self.rt.stopping.wait())
            if not self.rt.stopping.is_set():
                self._notify_ready()
                if self.check_loop is not None:
                    self.check_task = asyncio.create_task(
                        self._run_check_loop(self.check_loop), name="check_loop"
                    )
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
            self.notifier.close()
        return 0

    async def _start_api(self) -> None:
        if not self.want_api:
            return
        actions: Actions = self.actions
        server = ApiServer(self.store, actions, self.config.api, self.listen)
        await server.start()
        self.server = server

    async def _wait_started(self) -> None:
        """Until every runner has first settled (running, failed or stopped), or a stop."""
        assert self.rt is not None
        await _first_of(
            self.rt.stopping.wait(), asyncio.gather(*(r.settled.wait() for r in self.runners))
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
                        log.error("runner died error=%r action=shutdown", exc)
                        self.store.emit("error", None, f"supervision task died: {exc!r}")
                        self.rt.stopping.set()
        finally:
            stop.cancel()

    def status_line(self) -> str:
        procs = self.store.snapshot.processes
        running = sum(1 for p in procs.values() if p.state == "running")
        down = sorted(
            f"{key_label(k)}={p.state}"
            for k, p in procs.items()
            if p.state in ("failed", "stopped")
        )
        text = f"{running}/{len(procs)} running"
        if down:
            text += "; " + ", ".join(down)
        return text

    def _publish_status(self) -> None:
        """systemd STATUS= whenever the summary changes (after READY=1)."""
        if not self._ready_sent:
            return
        status = self.status_line()
        if status != self._last_status:
            self._last_status = status
            self.notifier.status(status)

    def _notify_ready(self) -> None:
        status = self.status_line()
        self._ready_sent = True
        self._last_status = status
        self.notifier.ready(status)
        self.store.emit("ready", None, f"supervisor ready: {status}")
        log.info("supervisor ready %s", format_fields(status=status, pid=os.getpid()))

    async def _watchdog_loop(self, interval_s: float) -> None:
        """WATCHDOG=1 every interval while the loop runs and every runner is alive."""
        while True:
            if all(r.task is None or not r.task.done() for r in self.runners) or (
                self.rt is not None and self.rt.stopping.is_set()
            ):
                self.notifier.watchdog()
            await asyncio.sleep(interval_s)

    async def _run_check_loop(self, check_loop: CheckLoop) -> None:
        try:
            await check_loop(self)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the check loop failing must not take the workers down
            log.exception("check loop died error=%r action=continue unchecked", err)
            self.store.emit("error", None, f"check loop died: {err!r}")

    async def _apply_irqs(self) -> None:
        """The devices' IRQs onto their ranks' irq CPUs (blocking writes: the executor)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.runtime.executor, self.irq_keeper.apply)
        except Exception as err:  # IRQs degrade alone, never the workers
            log.exception("irq apply failed error=%r action=continue without", err)
            self.store.emit("error", None, f"IRQ binding failed: {err!r}")

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

    async def _shutdown(self) -> None:
        assert self.rt is not None
        self.rt.stopping.set()
        self.store.update(stopping=True)
        self.notifier.stopping("stopping: workers first, then the engine")
        self.store.emit("stopping", None, "supervisor stopping")
        log.info("stopping %s", format_fields(processes=len(self.runners), action="stop workers"))
        if self.check_task is not None:
            self.check_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.check_task
        workers = [r for r in self.runners if r.key != "engine"]
        engine = [r for r in self.runners if r.key == "engine"]
        await asyncio.gather(*(r.shutdown() for r in workers), return_exceptions=True)
        await asyncio.gather(*(r.shutdown() for r in engine), return_exceptions=True)
        await self._restore_irqs()
        if self.cgroups is not None:
            await asyncio.get_running_loop().run_in_executor(
                self.runtime.executor, _remove_cgroups, self.cgroups, [r.key for r in self.runners]
            )
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
        self.store.emit("restart_requested", key, f"{key_label(key)}: restart requested")
        return {"rank": key_label(key), "previous_state": old.state, "previous_pid": old.pid}


class DaemonActions:
    """The API's changing calls, done on the daemon (implements supervisor.api.Actions)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        # Replaced by the drift step with its own re-apply; None: re-apply the
        # process affinity of the plan (the shim's binding, after the fact).
        self.rebinder: Callable[[ProcKey | None], Awaitable[dict[str, Any]]] | None = None

    async def rebind(self, rank: int | None) -> dict[str, Any]:
        if rank is not None:
            self.daemon.runner(rank)  # KeyError -> 404
        if self.rebinder is not None:
            return await self.rebinder(rank)
        return await rebind_processes(self.daemon, rank, "api")

    async def restart(self, rank: int) -> dict[str, Any]:
        return await self.daemon.restart_rank(rank)


async def rebind_processes(daemon: Daemon, rank: ProcKey | None, reason: str) -> dict[str, Any]:
    """Re-apply every thread's planned process CPUs (the whole slot) to live processes."""
    rt = daemon.runtime
    if rt.stopping.is_set():
        raise SupervisorError("the supervisor is stopping")
    binder = Binder(rt.fs)
    loop = asyncio.get_running_loop()
    results: dict[str, Any] = {}
    for r in daemon.runners:
        if rank is not None and r.key != rank:
            continue
        status = r.status
        if r.child is None or status.pid is None:
            results[r.label] = {"state": status.state, "rebound": False}
            continue
        pid = status.pid
        try:
            done = await loop.run_in_executor(
                rt.executor, binder.set_process_affinity, pid, r.spec.slot.cpus
            )
        except KernelError as err:
            r.record_bind_failure("process", err.reason, str(err))
            results[r.label] = {"pid": pid, "rebound": False, "error": str(err)}
            continue
        for tid, failure in done.failed.items():
            r.record_bind_failure("thread", failure.reason, f"tid {tid}: {failure}")
        rt.store.count("rebinds", (r.label, reason))
        rt.store.emit(
            "rebind",
            r.key,
            f"{r.label}: re-bound {len(done.bound)} threads to {format_cpulist(r.spec.slot.cpus)}",
            pid=pid,
            threads=len(done.bound),
            failed=len(done.failed),
            reason=reason,
        )
        results[r.label] = {
            "pid": pid,
            "rebound": done.ok,
            "threads": len(done.bound),
            "failed": len(done.failed),
        }
    return {"reason": reason, "processes": results}


# -- the command -------------------------------------------------------------------


class ManagedCgroups:
    """`ProcessCgroups` over `supervisor.bind.cgroup.CgroupManager`: one cgroup per
    process key ("engine", "rank0", ...), made at its first start, reused after."""

    def __init__(self, manager: CgroupManager) -> None:
        self.manager = manager
        self.made: dict[ProcKey, ProcessCgroup] = {}

    @staticmethod
    def name(key: ProcKey) -> str:
        return "engine" if key == "engine" else f"rank{key}"

    def create(self, key: ProcKey, slot: Slot) -> tuple[str, ...]:
        pc = self.made.get(key)
        if pc is None:
            pc = self.manager.create(self.name(key), slot.cpus, slot.mems)
            self.made[key] = pc
        else:
            self.manager.update(pc, slot.cpus, slot.mems)
        return pc.dirs

    def remove(self, key: ProcKey) -> None:
        pc = self.made.pop(key, None)
        if pc is not None:
            self.manager.remove(pc)

    def close(self) -> None:
        self.manager.close()


def cgroups_for(config: Config, fs: HostFS, env: Mapping[str, str]) -> ManagedCgroups | None:
    """Per-process cgroups when `cgroup = "auto"` and a writable subtree exists.

    INSTANCE_ENV names the instance dir's suffix, so that two supervisors on
    one host (or tests) keep apart; without it the dir is "placement-supervisor".
    """
    if config.cgroup == "off":
        return None
    setup = detect_cgroup_setup(fs)
    if setup is None:
        log.info(
            "cgroups none %s", format_fields(reason="no writable cgroup subtree", action="skip")
        )
        return None
    suffix = env.get(INSTANCE_ENV, "")
    try:
        manager = CgroupManager(fs, setup, suffix=suffix)
    except ValueError as err:
        raise ConfigError(f"{INSTANCE_ENV}={suffix!r}: {err}") from None
    log.info(
        "cgroups %s",
        format_fields(version=setup.version, parent=setup.cpuset_parent, instance=manager.instance),
    )
    return ManagedCgroups(manager)


def _remove_cgroups(cgroups: ProcessCgroups, keys: Sequence[ProcKey]) -> None:
    for key in keys:
        try:
            cgroups.remove(key)
        except (KernelError, OSError) as err:
            log.warning("cgroup remove failed %s", format_fields(rank=key_label(key), error=err))
    with contextlib.suppress(KernelError, OSError):
        cgroups.close()


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
        check_loop=default_check_loop,
    )
    log.info(
        "starting %s",
        format_fields(
            config=config.path, pid=os.getpid(), processes=len(daemon.specs), action="spawn"
        ),
    )
    return run_loop(daemon.run())


def run_loop(main: Awaitable[int]) -> int:
    """Run `main` on a uvloop event loop (asyncio's own where uvloop is missing)."""
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_as_coroutine(main))


async def _as_coroutine(main: Awaitable[int]) -> int:
    return await main


async def _first_of(*waits: Awaitable[Any]) -> None:
    """Wait until the first of `waits` completes.

    Coroutines (and gathers) given here are wrapped and cancelled afterwards;
    futures and tasks the caller passes in (a child's exit) are left alone.
    """
    futures: list[asyncio.Future[Any]] = []
    owned: list[asyncio.Future[Any]] = []
    for w in waits:
        if isinstance(w, asyncio.Future):
            futures.append(w)
        else:
            wrapped: asyncio.Future[Any] = asyncio.ensure_future(w)
            futures.append(wrapped)
            owned.append(wrapped)
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in owned:
            f.cancel()
