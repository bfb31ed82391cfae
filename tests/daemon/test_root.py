"""The daemon in-process: real children through the real shim, on a uvloop loop.

Each test runs `Daemon.run()` on this host's real topology and plan, with a
small reporting child as the worker (tests/daemon_support.py), and watches
the StateStore. The command-line daemon is exercised in test_daemon_process.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop
from aiohttp import web

from supervisor.config import Config, ReadyProbe, parse_config
from supervisor.cpulist import format_cpulist
from supervisor.daemon.root import Daemon, prepare, run_loop
from supervisor.hostfs import HostFS
from supervisor.plan.keys import ProcKey
from supervisor.plan.placement import DeviceRef, Placement, RankPlacement, Slot
from supervisor.run.probe import wait_ready
from supervisor.run.spec import build_specs, child_env, resolve_python, worker_argv
from supervisor.state import ProcessStatus
from supervisor.worker import SLOT_ENV, parse_slot_env
from tests.support.children import report_of, reports, status_field, write_child
from tests.support.daemon_support import (
    child_config,
    free_port,
)
from tests.support.poll import until

FS = HostFS("/")
Scenario = Callable[[Daemon], Awaitable[None]]


# -- pure parts -------------------------------------------------------------------


def _rank(rank: int, kind: Any, indices: tuple[int, ...], cpus: tuple[int, ...]) -> RankPlacement:
    devices = tuple(DeviceRef(kind, i, f"0000:{0x18 + i:02x}:00.0", 0) for i in indices)
    return RankPlacement(
        rank=rank,
        device=devices[0],
        slot=Slot(cpus, (0,), {"main": cpus}),
        local_rank=rank,
        devices=devices if len(devices) > 1 else (),
    )


def _placement(kind: Any, per_rank: tuple[tuple[int, ...], ...]) -> Placement:
    ranks = tuple(_rank(r, kind, idx, (2 * r, 2 * r + 1)) for r, idx in enumerate(per_rank))
    return Placement("numa-affine", Slot((8,), (0,), {"main": (8,)}), ranks)


def _config(**doc: Any) -> Config:
    base: dict[str, Any] = {"workers": {"command": ["w", "--rank", "{rank}"]}}
    base.update(doc)
    return parse_config(base, "test.toml")


@pytest.mark.parametrize(
    ("kind", "var"),
    [
        ("nvidia", "CUDA_VISIBLE_DEVICES"),
        ("ascend", "ASCEND_RT_VISIBLE_DEVICES"),
        ("amd", "HIP_VISIBLE_DEVICES"),
    ],
)
def test_each_rank_sees_only_its_devices(kind: str, var: str) -> None:
    placement = _placement(kind, ((4,), (5,)))
    specs = build_specs(_config(), placement, {var: "4,5", "PATH": "/bin"})
    assert [s.env[var] for s in specs if s.key != "engine"] == ["4", "5"]


def test_a_rank_with_two_devices_sees_both() -> None:
    specs = build_specs(_config(), _placement("nvidia", ((0, 1), (2, 3))), {})
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs if s.key != "engine"] == ["0,1", "2,3"]


def test_cpu_standins_set_no_visibility_unless_configured() -> None:
    plain = build_specs(_config(), _placement("cpu", ((0,), (1,))), {})
    assert not any("CUDA_VISIBLE_DEVICES" in s.env for s in plain)
    named = build_specs(
        _config(visible_devices_env="MY_DEVICES"), _placement("cpu", ((0,), (1,))), {}
    )
    assert [s.env["MY_DEVICES"] for s in named if s.key != "engine"] == ["0", "1"]


def test_amd_children_drop_the_operators_rocr_filter() -> None:
    specs = build_specs(_config(), _placement("amd", ((2,),)), {"ROCR_VISIBLE_DEVICES": "2,3"})
    worker = specs[-1]
    assert worker.env["HIP_VISIBLE_DEVICES"] == "2"
    assert "ROCR_VISIBLE_DEVICES" not in worker.env


def test_extra_env_is_set_only_where_unset() -> None:
    config = _config(
        workers={
            "command": ["w"],
            "env": {"HCCL_CONNECT_TIMEOUT": "240", "HCCL_EXEC_TIMEOUT": "200"},
        }
    )
    specs = build_specs(config, _placement("ascend", ((0,),)), {"HCCL_CONNECT_TIMEOUT": "900"})
    env = specs[-1].env
    assert env["HCCL_CONNECT_TIMEOUT"] == "900"  # the operator's value wins
    assert env["HCCL_EXEC_TIMEOUT"] == "200"


def test_nvidia_children_get_pci_bus_order_unless_set() -> None:
    specs = build_specs(_config(), _placement("nvidia", ((0,),)), {})
    assert specs[-1].env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    mine = build_specs(_config(), _placement("nvidia", ((0,),)), {"CUDA_DEVICE_ORDER": "X"})
    assert mine[-1].env["CUDA_DEVICE_ORDER"] == "X"


def test_slot_env_carries_the_plan_and_notify_vars_are_dropped() -> None:
    base = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "1", "A": "b"}
    specs = build_specs(
        _config(engine={"command": ["e"]}), _placement("nvidia", ((0,), (1,))), base
    )
    assert [s.key for s in specs] == ["engine", 0, 1]
    for spec in specs:
        slot = parse_slot_env(spec.env[SLOT_ENV])
        assert slot.cpus == spec.slot.cpus
        assert slot.key == str(spec.key)
        assert spec.env["A"] == "b"
        assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(spec.env)


def test_worker_command_placeholders() -> None:
    rank = _rank(1, "nvidia", (5,), (2, 3))
    argv = worker_argv(
        ["w", "--rank={rank}", "{local_rank}", "{device_index}", "{bus_id}", "{world_size}"],
        rank,
        8,
    )
    assert argv == ("w", "--rank=1", "1", "5", "0000:1d:00.0", "8")


def test_python_means_the_supervisors_interpreter() -> None:
    assert resolve_python(["python", "-m", "x"], "/venv/bin/python") == (
        "/venv/bin/python",
        "-m",
        "x",
    )
    assert resolve_python(["/usr/bin/python3", "x"], "/venv/bin/python") == (
        "/usr/bin/python3",
        "x",
    )


def test_child_env_defaults_then_forced() -> None:
    env = child_env({"A": "1", "B": "2"}, {"B": "x", "C": "3"}, {"A": "forced"}, drop=("Z",))
    assert env == {"A": "forced", "B": "2", "C": "3"}


# -- the daemon with real children ------------------------------------------------


def run_daemon(config: Config, scenario: Scenario, timeout_s: float = 60.0) -> Daemon:
    """Run the daemon until `scenario` returns, then stop it as SIGTERM would."""
    env = dict(os.environ)
    topology, placement = prepare(config, env, FS)
    stop = asyncio.Event()  # the shutdown trigger
    daemon = Daemon(config, topology, placement, env=env, fs=FS, api=False, shutdown_trigger=stop)

    async def main() -> None:
        async with asyncio.timeout(timeout_s):
            task = asyncio.create_task(daemon.run())
            try:
                await until(lambda: daemon.rt is not None)
                await scenario(daemon)
            finally:
                stop.set()  # as SIGTERM would
                assert await task == 0

    loop_debug_run(main)
    return daemon


SLOW_CALLBACK_S = 0.5  # generous: this 2-CPU machine is shared with other test runs


class _SlowCallbacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "took" in message and "Executing" in message:
            self.messages.append(message)


def loop_debug_run(main: Callable[[], Awaitable[None]]) -> None:
    """Run on uvloop in debug mode; fail if any callback held the loop too long
    (a blocking /proc scan or syscall batch slipped onto the loop)."""
    slow = _SlowCallbacks()
    logging.getLogger("asyncio").addHandler(slow)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop, debug=True) as runner:
            runner.get_loop().slow_callback_duration = SLOW_CALLBACK_S
            runner.run(main())  # type: ignore[arg-type]
    finally:
        logging.getLogger("asyncio").removeHandler(slow)
    assert slow.messages == []


def status(daemon: Daemon, key: ProcKey) -> ProcessStatus:
    return daemon.store.snapshot.processes[key]


def all_running(daemon: Daemon) -> bool:
    procs = daemon.store.snapshot.processes
    return all(p.state == "running" for p in procs.values())


def events(daemon: Daemon, kind: str, key: ProcKey | None = None) -> list[Any]:
    return [
        e for e in daemon.store.snapshot.events if e.kind == kind and (key is None or e.key == key)
    ]


@pytest.fixture
def child(tmp_path: Path) -> tuple[Path, Path]:
    return write_child(tmp_path)


def test_child_reports_the_planned_affinity_and_policy_first(child: tuple[Path, Path]) -> None:
    script, out = child
    config = parse_config(child_config(script, out), "test.toml")
    seen: dict[ProcKey, ProcessStatus] = {}

    async def scenario(daemon: Daemon) -> None:
        await until(lambda: all_running(daemon))
        for key in (0, 1):
            pid = status(daemon, key).pid
            assert pid is not None
            await until(lambda key=key, pid=pid: report_of(out, str(key), pid))
            seen[key] = status(daemon, key)

    daemon = run_daemon(config, scenario)
    placement = daemon.placement
    for key in (0, 1):
        slot = placement.slot(key)
        st = seen[key]
        assert st.pid is not None
        report = report_of(out, str(key), st.pid)
        assert report is not None
        assert report["cpus"] == sorted(slot.cpus)
        assert report["policy"] == f"bind:{format_cpulist(slot.mems)}"
        assert st.mempolicy == "bind" and st.bound and st.id is not None
        assert json.loads(report["env"][SLOT_ENV])["cpus"] == list(slot.cpus)
        assert "NOTIFY_SOCKET" not in report["env"]
        spawn = events(daemon, "spawn", key)[0]
        assert spawn.fields["cpus"] == list(slot.cpus) and spawn.fields["mempolicy"] == "bind"
    # After the stop every child is reaped and marked stopped.
    assert {p.state for p in daemon.store.snapshot.processes.values()} == {"stopped"}
    assert daemon.store.snapshot.stopping


def test_a_signal_sets_the_shutdown_trigger_and_an_embedded_daemon_never_exits_on_a_second(
    child: tuple[Path, Path],
) -> None:
    """SIGTERM only sets the trigger the embedding program passed in; the stop
    follows. A second one is counted, never a forced exit here (only the real
    daemon, run_command's, exits at once: tests/daemon/test_forced_exit.py)."""
    script, out = child
    config = parse_config(child_config(script, out), "test.toml")

    async def scenario(daemon: Daemon) -> None:
        await until(lambda: all_running(daemon))
        # Both at once, while the loop's handlers are surely installed (after the
        # stop they are not, and a SIGTERM would end the test run).
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        await until(lambda: daemon.signals_received == 2)
        assert daemon.shutdown_trigger.is_set()
        await until(lambda: events(daemon, "stopping"))

    daemon = run_daemon(config, scenario)
    assert {p.state for p in daemon.store.snapshot.processes.values()} == {"stopped"}
    assert len(events(daemon, "stopping")) == 1


def test_a_killed_worker_comes_back_rebound_after_backoff(child: tuple[Path, Path]) -> None:
    script, out = child
    config = parse_config(child_config(script, out), "test.toml")

    async def scenario(daemon: Daemon) -> None:
        await until(lambda: all_running(daemon))
        old = status(daemon, 0).pid
        other = status(daemon, 1).pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        await until(lambda: status(daemon, 0).pid not in (None, old) and all_running(daemon))
        new = status(daemon, 0).pid
        assert new is not None
        report = await until(lambda: report_of(out, "0", new))
        planned = sorted(daemon.placement.slot(0).cpus)
        assert report["cpus"] == planned
        assert status_field(new, "Cpus_allowed_list") == format_cpulist(planned)
        assert status(daemon, 0).restarts == 1
        assert status(daemon, 1).pid == other  # the other rank never noticed

    daemon = run_daemon(config, scenario)
    restart = events(daemon, "restart", 0)
    assert restart and "SIGKILL" in restart[0].fields["reason"]
    assert restart[0].fields["delay_s"] == 0.2
    states = [e.fields["new"] for e in events(daemon, "state", 0)]
    assert states[:4] == ["running", "backoff", "starting", "running"]
    assert daemon.store.snapshot.counters.restarts["0"] == 1


def test_a_crash_loop_fails_one_rank_while_the_other_runs(child: tuple[Path, Path]) -> None:
    script, out = child
    config = parse_config(child_config(script, out, mode="crash-rank-1"), "test.toml")

    async def scenario(daemon: Daemon) -> None:
        await until(lambda: status(daemon, 1).state == "failed")
        assert status(daemon, 0).state == "running"
        first = status(daemon, 0).pid
        assert len(reports(out, "1")) == 3  # crash_loop_limit starts, then held down
        # A manual restart (the API's) brings the failed rank back to try again.
        assert daemon.actions is not None
        await daemon.actions.restart(1)
        await until(lambda: len(reports(out, "1")) == 4)
        await until(lambda: status(daemon, 1).state == "failed")
        assert status(daemon, 0).pid == first

    daemon = run_daemon(config, scenario)
    failed = events(daemon, "failed", 1)
    assert failed and "crash loop" in failed[0].message
    assert not events(daemon, "restart", 0)


def test_a_missing_command_is_a_clear_error_and_the_policy_applies(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-worker")
    doc = child_config(tmp_path, tmp_path)
    doc["workers"] = {"command": [missing, "--rank", "{rank}"]}
    doc["restart"]["crash_loop_limit"] = 2
    config = parse_config(doc, "test.toml")

    async def scenario(daemon: Daemon) -> None:
        await until(lambda: {status(daemon, k).state for k in (0, 1)} == {"failed"})
        assert daemon.rt is not None and not daemon.rt.stopping.is_set()  # still supervising

    daemon = run_daemon(config, scenario)
    failures = events(daemon, "spawn_failed", 0)
    assert len(failures) == 2
    assert missing in failures[0].message and "ENOENT" in failures[0].message
    assert "could not start" in events(daemon, "failed", 0)[0].message
    assert events(daemon, "ready")  # start-up finished (degraded), systemd would get READY=1


def test_workers_start_only_after_the_engine_is_ready(child: tuple[Path, Path]) -> None:
    script, out = child
    config = parse_config(child_config(script, out, engine=True), "test.toml")

    async def scenario(daemon: Daemon) -> None:
        await until(lambda: all_running(daemon))

    daemon = run_daemon(config, scenario)
    ready = events(daemon, "ready", "engine")[0]
    first_worker_spawn = min(
        e.seq for e in daemon.store.snapshot.events if e.kind == "spawn" and e.key != "engine"
    )
    assert ready.seq < first_worker_spawn
    # Workers stop before the engine.
    exits = [e.key for e in daemon.store.snapshot.events if e.kind == "exit"]
    assert exits[-1] == "engine"


def test_an_engine_that_never_gets_ready_fails_and_workers_wait(
    child: tuple[Path, Path],
) -> None:
    script, out = child
    doc = child_config(script, out, engine=True)
    doc["ready"] = {"file": str(out / "never"), "timeout_s": 0.5}
    doc["restart"]["crash_loop_limit"] = 1
    config = parse_config(doc, "test.toml")

    async def scenario(daemon: Daemon) -> None:
        await until(lambda: status(daemon, "engine").state == "failed")
        await until(lambda: {status(daemon, k).state for k in (0, 1)} == {"stopped"})

    daemon = run_daemon(config, scenario)
    assert events(daemon, "ready_failed", "engine")
    assert events(daemon, "not_started", 0) and events(daemon, "not_started", 1)
    assert not events(daemon, "spawn", 0)


# -- readiness probes against real sockets ------------------------------------------


def test_http_probe_waits_for_a_2xx() -> None:
    port = free_port()
    answers = iter([503, 503, 200])

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=next(answers, 200))

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            probe = ReadyProbe(http=f"http://127.0.0.1:{port}/health", timeout_s=10)
            result = await wait_ready(probe, lambda: True, interval_s=0.01)
            assert result.ready and result.detail.startswith("http ")
            # Long enough for one answer on a loaded machine: the probe retries the 404 till then.
            never = ReadyProbe(http=f"http://127.0.0.1:{port}/missing", timeout_s=2)
            failed = await wait_ready(never, lambda: True, interval_s=0.01)
            assert not failed.ready and "HTTP 404" in failed.detail
        finally:
            await runner.cleanup()

    loop_debug_run(main)


def test_tcp_probe_reports_refusal_and_stops_when_the_process_exits() -> None:
    async def main() -> None:
        probe = ReadyProbe(tcp=f"127.0.0.1:{free_port()}", timeout_s=0.3)
        refused = await wait_ready(probe, lambda: True, interval_s=0.01)
        assert not refused.ready and "refused" in refused.detail.lower()
        gone = await wait_ready(ReadyProbe(tcp="127.0.0.1:1", timeout_s=30), lambda: False)
        assert not gone.ready and gone.detail == "process exited"

    loop_debug_run(main)


def test_run_loop_falls_back_to_asyncio_without_uvloop() -> None:
    # A real interpreter where `import uvloop` fails (None in sys.modules makes
    # the import raise ImportError), as on a host without the wheel.
    program = (
        "import sys, asyncio; sys.modules['uvloop'] = None\n"
        "from supervisor.daemon.root import run_loop\n"
        "async def main():\n"
        "    return 7 if type(asyncio.get_running_loop()).__module__.startswith('asyncio') else 1\n"
        "sys.exit(run_loop(main()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 7, done.stderr
    # And uvloop's where it is installed.
    assert asyncio.run(_loop_module()) != "" and run_loop(_loop_module()) == "uvloop"


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]
