"""One supervised process, spawn to reap (does I/O: processes, pipes, the executor).

`Runner` spawns the engine or one rank through the exec shim, records the
shim's bind report, restarts the child by the policy of `supervisor.run.restart`
and stops it (TERM to its group, KILL after a timeout). `Runtime` is what the
daemon's runners share; `supervisor.bind.report.bound_as_planned` judges a report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from supervisor.bind.report import (
    ShimReport,
    ShimReportError,
    bound_as_planned,
    cpus_as_planned,
    parse_shim_report,
    shim_argv,
)
from supervisor.config import Config
from supervisor.cpulist import format_cpulist
from supervisor.errors import KernelError, reason_of_errno
from supervisor.events import Recorder
from supervisor.hostfs import HostFS
from supervisor.in_force import PlanInForce
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Slot
from supervisor.procfs.identity import ProcessId
from supervisor.procfs.stat import read_proc_stat
from supervisor.run import restart
from supervisor.run.probe import await_ready
from supervisor.run.procs import ChildProcess, first_of, read_until_eof, spawn
from supervisor.run.restart import RestartDecision, RestartHistory, RunOutcome, decide_restart
from supervisor.run.spec import ChildSpec, SpecOf
from supervisor.run.stop_budget import stop_wait_s
from supervisor.state import BindTarget, ProcessState, ProcessStatus, StateStore

log = logging.getLogger("placement_supervisor.runner")

REPORT_TIMEOUT_S = 30.0  # the shim binds and execs in milliseconds; this is a hung cgroup write


# -- what the runners share (the composition root fills it) -------------------------


class ProcessCgroups(Protocol):
    """Per-process cgroups (`supervisor.bind.cgroup`): directories the shim joins."""

    def create(self, key: ProcKey, slot: Slot) -> tuple[str, ...]: ...

    def remove(self, key: ProcKey) -> None: ...

    def close(self) -> None: ...


class ProcessTrees(Protocol):
    """The daemon's tree keeper (`supervisor.trees.keeper.TreeKeeper`)."""

    def set_root(
        self,
        key: ProcKey,
        pid: int,
        ident: ProcessId | None,
        *,
        adopted: bool = False,
        cgroup_dir: str | None = None,
    ) -> None:
        """`pid` is `key`'s root; `ident`, who it is (None until its start time is
        read); `cgroup_dir`, a cgroup holding its tree, read only (attach mode)."""

    def clear_root(self, key: ProcKey) -> None: ...

    def release(self, key: ProcKey) -> None: ...

    def leaving(self, pids: Sequence[int]) -> None: ...

    def descendants(self, pid: int) -> list[int]: ...

    def owner_of(self, pid: int) -> ProcKey | None: ...

    def signal_tree(self, key: ProcKey, sig: int, *, roots: bool = False) -> int: ...

    async def end_tree(self, key: ProcKey, timeout_s: float, *, roots: bool = True) -> int: ...


@dataclass(slots=True)
class Runtime:
    """What the daemon's parts share: the plan in force, the store, the executor, the stop flag."""

    plan: PlanInForce  # the one holder of the config: read at each use (a reload replaces it)
    store: StateStore
    fs: HostFS
    executor: ThreadPoolExecutor
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    cgroups: ProcessCgroups | None = None
    python: str = sys.executable
    on_state_change: Callable[[], None] | None = None  # e.g. a new systemd STATUS=
    trees: ProcessTrees | None = None  # every process below each supervised one
    stop_started_at: float | None = None  # monotonic, once the daemon's stop began

    @property
    def config(self) -> Config:
        """The config in force: restart policy, stop timeouts, the ready probe."""
        return self.plan.config

    def stop_wait_s(self, key: ProcKey) -> float:
        """TERM to KILL for `key`: stop_timeout_s, cut to fit stop_grace_s in a stop."""
        return stop_wait_s(
            self.config.stop_timeout_s,
            self.config.stop_grace_s,
            self.stop_started_at,
            key,
            has_engine=self.config.engine is not None,
            now=time.monotonic(),
        )


# -- one supervised process --------------------------------------------------------


class Runner:
    """Runs one process (the engine or one rank) for the daemon's lifetime.

    Owns the child from spawn to reap: every path out of `run()` stops and
    reaps it. Restart requests and the daemon's stop arrive as `interrupt`.
    """

    def __init__(self, rt: Runtime, key: ProcKey, spec_of: SpecOf) -> None:
        self.rt = rt
        self.spec_of = spec_of
        self.key = key
        self.label = key_label(key)
        self.child: ChildProcess | None = None
        self.history = RestartHistory()
        self.interrupt = asyncio.Event()
        self.restart_requested = False
        self.settled = asyncio.Event()  # first reached running, failed or stopped
        self.ready = asyncio.Event()  # first readiness (the engine's probe passed)
        # First spawn attempt done (spawned and bound, or failed to), or waiting
        # on the engine: what READY=1 waits for, not the engine's readiness.
        self.launched = asyncio.Event()
        self.waiting: str | None = None  # while the probe waits: "engine loading: ..."
        self._watchers: list[asyncio.Future[None]] = []
        self.gate: Runner | None = None  # workers wait for the engine's first readiness
        self.task: asyncio.Task[None] | None = None
        self.report: ShimReport | None = None
        self.recorder = Recorder(rt.store, log)

    # -- state -----------------------------------------------------------

    @property
    def spec(self) -> ChildSpec:
        """What to run now: the plan in force's, asked at each spawn."""
        return self.spec_of(self.key)

    @property
    def status(self) -> ProcessStatus:
        return self.rt.store.snapshot.processes.get(self.key) or ProcessStatus(self.key)

    def set_status(self, **changes: Any) -> ProcessStatus:
        old = self.status
        new = replace(old, **changes)
        self.rt.store.set_process(new)
        if new.state != old.state:
            self.recorder.note(
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
            while True:
                try:
                    await self._supervise()
                    return
                except Exception as err:  # any bug, or an OSError of ours (EMFILE)
                    await self._reap_on_exit()
                    if restart.is_fd_shortage(err):  # the host's state, not this rank's: back off
                        self._spawn_failed(f"out of file descriptors: {err}", None)
                        await self._back_off(RunOutcome(None, 0.0, time.monotonic(), no_fds=True))
                        continue
                    # Isolated to this rank: failed, held down; the daemon and other ranks go on.
                    self._runner_failed(err)
                    if not await self._hold_down():
                        return
                    self._manual_restart()
        finally:
            await self._reap_on_exit()

    async def _back_off(self, outcome: RunOutcome) -> RestartDecision:
        """The policy's decision on `outcome`; a restart waits its backoff first."""
        decision = decide_restart(self.rt.config.restart, self.history, outcome)
        self.history = decision.history
        if decision.action != "restart":
            return decision
        restarts, delay_s = self.status.restarts + 1, decision.delay_s
        self.set_status(
            state="backoff",
            backoff_s=delay_s,
            next_start_at=time.time() + delay_s,
            restarts=restarts,
            pid=None,
        )
        self.recorder.restart_scheduled(self.key, decision.reason, decision.delay_s, restarts)
        if await self._wait_interrupt(decision.delay_s) and self.restart_requested:
            self._manual_restart()
        return decision

    def _runner_failed(self, err: Exception) -> None:
        reason = f"supervision error: {type(err).__name__}: {err}"
        self.set_status(state="failed", pid=None, backoff_s=0.0, next_start_at=None)
        self.recorder.note(
            "failed",
            self.key,
            f"{self.label}: {reason}",
            log_message="process down",
            level=logging.ERROR,
            state="failed",
            reason=reason,
            action="hold",
        )
        log.debug("supervision error traceback rank=%s", self.label, exc_info=err)

    async def _hold_down(self) -> bool:
        """Held down until someone restarts it by hand (True) or the daemon stops (False)."""
        while not self.stopping and not self.restart_requested:
            await self._wait_interrupt(None)
        return not self.stopping

    async def _wait_gate(self) -> bool:
        """Wait for the engine's first readiness; False when stopping.

        While the engine is down for good (failed, or stopped by its policy)
        this worker shows `stopped` with an event saying why; a manual restart
        of the engine that brings it up releases the wait.
        """
        gate = self.gate
        assert gate is not None
        self.launched.set()  # nothing to spawn before the engine is ready
        announced = False
        while not gate.ready.is_set():
            if self.stopping:
                return False
            engine_state = gate.status.state
            if engine_state in ("failed", "stopped") and not announced:
                announced = True
                self.set_status(state="stopped")
                self.recorder.note(
                    "not_started",
                    self.key,
                    f"{self.label}: not started: the engine is {engine_state}",
                    log_message="not started",
                    level=logging.WARNING,
                    engine=engine_state,
                    action="wait for engine",
                )
            await first_of(gate.next_change(), self.rt.stopping.wait())
        self.restart_requested = False  # a restart asked for while waiting: this is the start
        self.interrupt.clear()
        return not self.stopping

    async def _supervise(self) -> None:
        while not self.stopping:
            outcome = await self._run_once()
            if self.stopping:
                return
            if self.restart_requested:
                self._manual_restart()
                continue
            decision = await self._back_off(outcome)
            if decision.action == "restart":
                continue
            state: ProcessState = "failed" if decision.action == "fail" else "stopped"
            self.set_status(state=state, pid=None, backoff_s=0.0, next_start_at=None)
            self.recorder.note(
                state,
                self.key,
                f"{self.label}: {decision.reason}",
                log_message="process down",
                level=logging.ERROR if state == "failed" else logging.INFO,
                state=state,
                reason=decision.reason,
                action="hold",
            )
            if not await self._hold_down():
                return
            self._manual_restart()

    def _manual_restart(self) -> None:
        self.restart_requested = False
        self.interrupt.clear()
        self.history = RestartHistory()
        self.recorder.restart_counted(self.key)
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
        self.launched.set()
        if child is None:
            return RunOutcome(None, 0.0, time.monotonic())
        exit_future = child.wait()
        exec_ok = self.report is not None and not self.report.exec_failed
        not_ready = False
        if self.report is None:
            # No report: the shim failed before binding or hangs; never leave
            # an unaccounted-for process behind.
            await child.stop(self.rt.stop_wait_s(self.key))
        elif exec_ok and not await self._await_ready(child, exit_future):
            # The probe gave up on a live engine: stop it and count a failed
            # start, whatever it exits with once stopped (often 0 on TERM).
            not_ready = True
            await child.stop(self.rt.stop_wait_s(self.key))
        elif exec_ok:
            await first_of(exit_future, self.interrupt.wait())
            if not exit_future.done():  # stop or restart request
                self.interrupt.clear()
                await self._stop_child(child, "restart" if self.restart_requested else "stop")
        code = await exit_future
        # Its whole tree goes with it (setsid descendants, orphans) before any restart.
        await self._end_tree()
        ended = time.monotonic()
        self.child = None
        self.set_status(exit_code=code)
        # An exit nobody asked for is worth an operator's attention.
        expected = self.stopping or self.restart_requested
        self.recorder.note(
            "exit",
            self.key,
            f"{self.label}: pid {child.pid} exited ({code})",
            log_message="exit",
            level=logging.INFO if expected else logging.WARNING,
            pid=child.pid,
            exit_code=code,
            ran_s=round(ended - started, 3),
        )
        return RunOutcome(code if exec_ok else None, ended - started, ended, not_ready=not_ready)

    async def _stop_child(self, child: ChildProcess, why: str) -> int:
        timeout_s = self.rt.stop_wait_s(self.key)
        fields = format_fields(rank=self.label, pid=child.pid, why=why, timeout_s=f"{timeout_s:g}")
        log.info("stopping %s", fields)
        # From the TERM to its exit the process is on its way out: not ready
        # (/readyz, placement_ready, STATUS=), though it may still answer.
        self.set_status(state="stopping")
        if self.rt.trees is not None:
            # TERM reaches the child's group; its setsid descendants get theirs here.
            self.rt.trees.signal_tree(self.key, signal.SIGTERM)
        return await child.stop(timeout_s)

    async def _end_tree(self) -> None:
        trees = self.rt.trees
        if trees is not None:
            await trees.end_tree(self.key, self.rt.stop_wait_s(self.key))
            trees.clear_root(self.key)

    async def _await_ready(self, child: ChildProcess, exit_future: asyncio.Future[int]) -> bool:
        """For the engine with a probe: wait until it passes; True when ready or exited."""
        probe = self.rt.config.ready if self.key == "engine" else None
        if probe is None:
            self.mark_running(child)
            return True
        fs, notify = self.rt.fs, self.rt.on_state_change
        return await await_ready(self, probe, child, exit_future, fs=fs, on_state_change=notify)

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
                reason = err.reason if isinstance(err, KernelError) else reason_of_errno(err.errno)
                self.record_bind_failure("cgroup", reason, str(err))
        read_fd, write_fd = os.pipe()  # EMFILE here: run() retries after the backoff
        argv = shim_argv(
            self.rt.python,
            spec.slot.cpus,
            spec.slot.mems,
            spec.argv,
            cgroups=cgroup_dirs,
            user=spec.account.shim_user if spec.account is not None else None,
            report_fd=write_fd,
            parent_pid=os.getpid(),
            # KILL, not TERM: a worker that ignores TERM must not outlive a
            # SIGKILLed supervisor (its descendants are the guardian's).
            pdeathsig="KILL",
            mempolicy=spec.mempolicy,
        )
        try:
            # On the loop's thread, never a pool thread: see procs.spawn (PDEATHSIG).
            child = spawn(argv, spec.env, pass_fds=(write_fd,))
        except OSError as err:
            os.close(read_fd)
            os.close(write_fd)
            if restart.is_fd_shortage(err):
                raise  # not the command's fault: run() retries after the backoff
            self._spawn_failed(f"cannot start {argv[0]}: {err.strerror or err}", None)
            return None
        os.close(write_fd)
        self.child = child
        if self.rt.trees is not None:
            # Known as a root at once: what it forks while its report is read is its tree.
            self.rt.trees.set_root(self.key, child.pid, None)
        data = await read_until_eof(read_fd, REPORT_TIMEOUT_S)
        stat = await loop.run_in_executor(self.rt.executor, read_proc_stat, self.rt.fs, child.pid)
        ident = ProcessId.of(stat) if stat is not None else None
        self.set_status(pid=child.pid, id=ident)
        if self.rt.trees is not None:
            self.rt.trees.set_root(self.key, child.pid, ident)
        try:
            report = parse_shim_report(data)
        except ShimReportError as err:
            self.record_bind_failure("process", "error", f"no shim report: {err}")
            self._spawn_failed(f"the shim reported nothing ({err})", child.pid)
            return child
        self.report = report
        if report.user_error is not None:
            self._spawn_failed(report.user_error, child.pid)
            return child
        if report.exec_failed:
            self._spawn_failed(
                f"cannot execute {spec.argv[0]!r}: {report.exec_error} ({report.errno})",
                child.pid,
            )
            return child
        self._record_bind(child, report)
        return child

    def _spawn_failed(self, message: str, pid: int | None) -> None:
        self.recorder.note(
            "spawn_failed",
            self.key,
            f"{self.label}: {message}",
            log_message="spawn failed",
            level=logging.ERROR,
            pid=pid,
            error=message,
            action="restart policy",
        )

    def record_bind_failure(self, target: BindTarget, reason: str, message: str) -> None:
        self.recorder.bind_failed(self.key, target, reason, message, action="degrade")

    def _record_bind(self, child: ChildProcess, report: ShimReport) -> None:
        slot = self.spec.slot
        if report.affinity_error:
            self.record_bind_failure(
                "process", reason_of_errno(report.affinity_errno), report.affinity_error
            )
        mempolicy_allowed = self.rt.store.snapshot.allows("mempolicy")
        if report.mempolicy != self.spec.mempolicy and mempolicy_allowed:
            # Where the host denies a memory policy the start said so once
            # (capability missing): not a failure of this process, not counted.
            why = report.reason or f"mempolicy {report.mempolicy}"
            self.record_bind_failure("memory", reason_of_errno(report.mempolicy_errno), why)
        for i, err in enumerate(report.cgroup_errors):
            number = report.cgroup_errnos[i] if i < len(report.cgroup_errnos) else None
            self.record_bind_failure("cgroup", reason_of_errno(number), err)
        bound = bound_as_planned(
            report, slot, mempolicy_allowed=mempolicy_allowed, wanted=self.spec.mempolicy
        )
        self.set_status(
            mempolicy=report.mempolicy,
            mempolicy_reason=report.reason,
            cgroup=report.cgroups[0] if report.cgroups else None,
            bound=bound,
            cpus_bound=cpus_as_planned(report, slot),
        )
        cpus = format_cpulist(report.cpus)
        mems = format_cpulist(report.mems)
        self.recorder.note(
            "spawn",
            self.key,
            f"{self.label}: pid {child.pid} cpus={cpus} mems={mems} mempolicy={report.mempolicy}",
            log_message="spawn",
            log_fields={
                "pid": child.pid,
                "cpus": cpus,
                "mems": mems,
                "mempolicy": report.mempolicy,
                "reason": report.reason,
                "cgroup": ",".join(report.cgroups) or None,
                "bound": str(bound).lower(),
            },
            pid=child.pid,
            cpus=list(report.cpus),
            mems=list(report.mems),
            mempolicy=report.mempolicy,
            reason=report.reason,
            cgroups=list(report.cgroups),
            bound=bound,
        )

    async def _reap_on_exit(self) -> None:
        child = self.child  # still ours (`child_pids`) until reaped: no stray reaper takes it
        if child is not None and child.returncode is None:
            # Cancelled or stopping mid-run: the child never outlives its runner.
            code = await asyncio.shield(self._stop_child(child, "shutdown"))
            self.child = None
            await asyncio.shield(self._end_tree())
            self.recorder.note(
                "exit",
                self.key,
                f"{self.label}: pid {child.pid} stopped ({code})",
                log_message="exit",
                pid=child.pid,
                exit_code=code,
            )
        self.child = None
        if self.stopping:
            self.set_status(state="stopped", pid=None, backoff_s=0.0, next_start_at=None)

    async def shutdown(self) -> None:
        """Stop the child (TERM to its group, KILL after stop_timeout_s) and end `run`."""
        self.request_stop()
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
