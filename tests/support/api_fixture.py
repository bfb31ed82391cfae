"""Snapshots for the API, metrics and status tests, and a harness that serves one.

`two_socket_topology()` is a 2-socket, 4-GPU host (48 CPUs, SMT siblings N
and N+24) and `realistic_snapshot()` runs the real planner on it and fills in
what the daemon would have published after a few checks: pids, states,
observed threads/memory/IRQs, drift findings, counters and events.
`synthetic_snapshot()` is the benchmark's larger one (N ranks x M threads).

`python -m tests.support.api_fixture --listen HOST:PORT` serves an ApiServer over the
realistic snapshot, publishing a new snapshot every 0.5 s (as a check loop
does), and prints its addresses as one JSON line: the stand-in target for the
Prometheus test when the real daemon is not used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TypeVar

from supervisor.config import ApiConfig
from supervisor.listen import Listen, parse_listen
from supervisor.plan.keys import ProcKey
from supervisor.plan.placement import DeviceRef, Placement, PlanSettings, RankPlacement, Slot
from supervisor.plan.planner import plan
from supervisor.procfs.identity import ProcessId
from supervisor.serve.server import ApiServer
from supervisor.state import (
    CAPABILITY_NAMES,
    Capability,
    Counters,
    Finding,
    IrqObservation,
    Observation,
    ProcessStatus,
    Snapshot,
    StateStore,
    ThreadObservation,
)
from supervisor.topology.model import Allowed, Cpu, Device, Irq, Node, Topology

GIB = 1 << 30
T = TypeVar("T")
ALL_CPUS = 48


def two_socket_topology() -> Topology:
    """2 packages x 12 cores x 2 threads; node n = package n; 2 GPUs per node."""
    cpus = []
    for cpu_id in range(ALL_CPUS):
        core = cpu_id % 24
        package = core // 12
        cpus.append(Cpu(cpu_id, core % 12, package, 0, 0, package, frozenset({core, core + 24})))
    nodes = tuple(
        Node(
            n,
            frozenset(c.id for c in cpus if c.node == n),
            256 * GIB,
            ((0, 10 if n == 0 else 21), (1, 21 if n == 0 else 10)),
        )
        for n in (0, 1)
    )
    bdfs = ["0000:18:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:af:00.0"]
    devices = tuple(
        Device(
            "nvidia",
            i,
            bdf,
            i // 2,
            "numa_node",
            uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
            name="NVIDIA H100 80GB HBM3",
            irqs=(100 + i,),
        )
        for i, bdf in enumerate(bdfs)
    )
    every = frozenset(range(ALL_CPUS))
    return Topology(
        cpus=tuple(cpus),
        present=every,
        possible=every,
        nodes=nodes,
        allowed=Allowed(every, frozenset({0, 1}), "/", 2),
        devices=devices,
        irqs=tuple(Irq(100 + i, f"nvidia{i}", bdf) for i, bdf in enumerate(bdfs)),
    )


def _planned(topo: Topology) -> Placement:
    return plan(topo, PlanSettings())


def _threads(key: ProcKey, slot: Slot, pid: int, count: int) -> tuple[ThreadObservation, ...]:
    roles = sorted(slot.roles) or ["main"]
    out = [ThreadObservation(pid, "python" if key != "engine" else "engine", "main", slot.cpus)]
    for i in range(1, count):
        role = roles[i % len(roles)]
        out.append(ThreadObservation(pid + i, f"{role}-{i}"[:15], role, slot.role_cpus(role)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Scenario:
    """What differs from a healthy, steady state."""

    drifted_rank: int | None = 1  # one thread of this rank sits off-plan
    restarted_rank: int | None = 2  # this rank was restarted once
    failures: dict[tuple[str, str, str], int] = field(
        default_factory=lambda: {("3", "irq", "managed"): 1}
    )


def realistic_snapshot(
    scenario: Scenario | None = None, *, pid_base: int = 40000, now: float | None = None
) -> Snapshot:
    """A planned 4-GPU host after a few checks: everything running and bound."""
    sc = scenario or Scenario()
    now = time.time() if now is None else now
    topo = two_socket_topology()
    placement = _planned(topo)
    return _populate(placement, topo, sc, pid_base=pid_base, now=now, threads_per_proc=6)


def synthetic_snapshot(ranks: int, threads: int, *, now: float | None = None) -> Snapshot:
    """A hand-built plan of `ranks` ranks with `threads` observed threads each (benchmark)."""
    now = time.time() if now is None else now
    per = 8
    slots = []
    for r in range(ranks):
        base = 8 + r * per
        cpus = tuple(range(base, base + per))
        roles = {"main": cpus[:6], "irq": cpus[6:7], "comm": cpus[7:]}
        slots.append(
            RankPlacement(
                r,
                DeviceRef("nvidia", r, f"0000:{r + 16:02x}:00.0", r * 2 // ranks),
                Slot(cpus, (r * 2 // ranks,), roles),
            )
        )
    engine = Slot(tuple(range(8)), (0,), {"main": (0, 1), "so_compiler": (2, 3, 4, 5, 6, 7)})
    placement = Placement("numa-affine", engine, tuple(slots))
    topo = two_socket_topology()
    return _populate(placement, topo, Scenario(), pid_base=10000, now=now, threads_per_proc=threads)


def _populate(
    placement: Placement,
    topo: Topology,
    sc: Scenario,
    *,
    pid_base: int,
    now: float,
    threads_per_proc: int,
) -> Snapshot:
    keys: list[ProcKey] = ["engine"] if placement.engine is not None else []
    keys.extend(r.rank for r in placement.ranks)
    processes: dict[ProcKey, ProcessStatus] = {}
    observed: dict[ProcKey, Observation] = {}
    drift: dict[ProcKey, tuple[Finding, ...]] = {}
    for i, key in enumerate(keys):
        pid = pid_base + 1000 * i
        slot = placement.slot(key)
        restarts = 1 if key == sc.restarted_rank else 0
        processes[key] = ProcessStatus(
            key,
            state="running",
            pid=pid,
            id=ProcessId(pid, 123456 + i),
            restarts=restarts,
            mempolicy="bind",
            mempolicy_reason=None,
            bound=True,
        )
        threads = _threads(key, slot, pid, threads_per_proc)
        node = slot.mems[0]
        findings: tuple[Finding, ...] = ()
        if key == sc.drifted_rank:
            t = threads[-1]
            threads = (*threads[:-1], replace(t, cpus=tuple(range(ALL_CPUS))))
            findings = (
                Finding(
                    "thread_affinity", f"tid {t.tid}", "planned", f"0-{ALL_CPUS - 1}", "enforce"
                ),
            )
        irqs: tuple[IrqObservation, ...] = ()
        if key != "engine":
            rank = placement.rank(int(key))
            irq_cpus = slot.role_cpus("irq")
            irqs = tuple(
                IrqObservation(100 + d.index, irq_cpus, irq_cpus) for d in rank.all_devices
            )
        local = 3 * GIB + 512 * (1 << 20) * i
        remote = 64 * (1 << 20)
        other = 1 - node if node in (0, 1) else 0
        observed[key] = Observation(
            threads=threads,
            memory_bytes_by_node=MappingProxyType({node: local, other: remote}),
            local_memory_ratio=local / (local + remote),
            irqs=irqs,
            observed_at=now,
        )
        drift[key] = findings
    counters = Counters(
        bind_failures=MappingProxyType(dict(sc.failures)),
        drift_events=MappingProxyType(
            {} if sc.drifted_rank is None else {(str(sc.drifted_rank), "thread_affinity"): 2}
        ),
        rebinds=MappingProxyType(
            {} if sc.drifted_rank is None else {(str(sc.drifted_rank), "thread_affinity"): 2}
        ),
        restarts=MappingProxyType({} if sc.restarted_rank is None else {str(sc.restarted_rank): 1}),
        cpuset_changes=0,
        checks=42,
        check_seconds_sum=0.42,
        last_check_duration_s=0.011,
        last_check_at=now,
    )
    return Snapshot(
        placement=placement,
        topology=topo,
        processes=MappingProxyType(processes),
        observed=MappingProxyType(observed),
        drift=MappingProxyType(drift),
        counters=counters,
        started_at=now - 60.0,
        accelerator_kind="nvidia",
        config_path="/etc/placement-supervisor/config.toml",
        local_memory_threshold=0.9,
        ready_timeout_s=900.0,  # a [ready] probe, as configs/engines/vllm.toml has
        capabilities=MappingProxyType({name: Capability(name, True) for name in CAPABILITY_NAMES}),
    )


class RecordingActions:
    """A fake `Actions`: records calls, answers like the daemon, KeyError for unknown ranks."""

    def __init__(self, ranks: tuple[ProcKey, ...]) -> None:
        self.ranks = ranks
        self.calls: list[tuple[str, ProcKey | None]] = []

    async def rebind(self, rank: ProcKey | None) -> dict[str, Any]:
        if rank is not None and rank not in self.ranks:
            raise KeyError(rank)
        self.calls.append(("rebind", rank))
        return {"rebound": list(self.ranks) if rank is None else [rank]}

    async def restart(self, rank: ProcKey) -> dict[str, Any]:
        if rank not in self.ranks:
            raise KeyError(rank)
        self.calls.append(("restart", rank))
        return {"restarting": rank}


async def tick_loop(store: StateStore, interval_s: float) -> None:
    """Publish a new snapshot every `interval_s`, as the daemon's check loop does."""
    while True:
        await asyncio.sleep(interval_s)
        c = store.snapshot.counters
        store.update(
            counters=replace(
                c,
                checks=c.checks + 1,
                check_seconds_sum=c.check_seconds_sum + 0.01,
                last_check_duration_s=0.01,
                last_check_at=time.time(),
            )
        )


async def _serve(listen: str, interval_s: float) -> None:
    snap = realistic_snapshot()
    store = StateStore(snap)
    store.emit("spawn", 0, "spawned rank 0", pid=snap.processes[0].pid)
    server = ApiServer(
        store, RecordingActions(("engine", 0, 1, 2, 3)), ApiConfig(listen=parse_listen(listen))
    )
    await server.start()
    print(json.dumps({"addresses": list(server.addresses)}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ticker = asyncio.create_task(tick_loop(store, interval_s))
    await stop.wait()
    ticker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ticker
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--interval-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.listen, args.interval_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())


class ServerThread:
    """An ApiServer on its own event loop in a thread, for tests that talk to it over sockets.

    The loop runs in asyncio debug mode with a `slow_callback_duration`, and
    every "Executing ... took" warning lands in `slow_callbacks`: a handler
    that blocks the loop shows up there.
    """

    def __init__(
        self,
        snapshot: Snapshot,
        config: ApiConfig,
        *,
        listen: str | None = None,
        actions: Any = None,
        slow_callback_s: float = 0.5,
        **server_kwargs: Any,
    ) -> None:
        self.store = StateStore(snapshot)
        self.actions = actions or RecordingActions(snapshot.keys())
        self.loop = asyncio.new_event_loop()
        self.loop.set_debug(True)
        self.loop.slow_callback_duration = slow_callback_s
        self.server = ApiServer(self.store, self.actions, config, listen, **server_kwargs)
        self.slow_callbacks: list[str] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._handler = _SlowCallbackHandler(self.slow_callbacks)

    def __enter__(self) -> ServerThread:
        logging.getLogger("asyncio").addHandler(self._handler)
        self._thread.start()
        try:
            self.run(self.server.start())
        except BaseException:
            self._shutdown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.server.stop())
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
        logging.getLogger("asyncio").removeHandler(self._handler)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def change(self, fn: Callable[[StateStore], object]) -> None:
        """Change the store from its own loop (it has a single writer)."""

        async def apply() -> None:
            fn(self.store)

        self.run(apply())

    @property
    def tcp(self) -> Listen:
        return parse_listen(next(a for a in self.server.addresses if not a.startswith("unix:")))


class _SlowCallbackHandler(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing"):
            self.sink.append(message)
