"""The check loop against real processes: drift found, counted, enforced or only reported.

Most tests run the check loop (supervisor.watch.loop) alone, at a short
interval, over a real child the harness starts (tests/support/check_harness.py);
the demo's test runs the real `Daemon` in-process (the engine, the shim, the
start-up hook) with its loop. Both perturb or inspect the children through real
syscalls and /proc. Slots are
crafted where this 2-CPU host's own plan would merge every role into `main`:
a role test needs roles on different CPUs.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from supervisor.config import Config, parse_config
from supervisor.daemon.root import Daemon, prepare
from supervisor.hostfs import HostFS
from supervisor.plan.keys import ProcKey
from supervisor.plan.placement import Placement, RankPlacement, Slot
from supervisor.watch.loop import CheckLoop
from tests.support.check_harness import CheckHarness, checking
from tests.support.children import NAMED_THREADS_CHILD, write_child
from tests.support.daemon_support import DEMO_WORKER, free_port, merge_config, to_toml
from tests.support.poll import until

FS = HostFS("/")
Scenario = Callable[[Daemon, CheckLoop], Awaitable[None]]

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to move threads between"
)

# -- running the daemon with the checker ------------------------------------------------


def child_doc(script: Path, out: Path, spec: dict[str, Any], **extra: Any) -> dict[str, Any]:
    spec_file = out / f"spec-{len(list(out.glob('spec-*')))}.json"
    spec_file.write_text(json.dumps(spec))
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 3,
        "workers": {"command": ["python", str(script), str(out), "{rank}", str(spec_file)]},
        "placement": {"rank_roles": {}, "engine": {"enabled": False}},
        "drift": {"check_interval_s": 0.1},
        "threads": {
            "comm": {"process": "workers", "pattern": "comm*"},
            "release": {"process": "workers", "pattern": "release*"},
        },
    }
    return merge_config(doc, extra)


def config_of(doc: dict[str, Any], tmp_path: Path) -> Config:
    # Through a real file: [drift.policy] is a nested table.
    path = tmp_path / "config.toml"
    text = to_toml({k: v for k, v in doc.items() if k not in ("threads", "drift")})
    drift = dict(doc.get("drift", {}))
    policy = drift.pop("policy", {})
    text += "[drift]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in drift.items())
    if policy:
        text += "[drift.policy]\n" + "".join(f'{k} = "{v}"\n' for k, v in policy.items())
    for name, table in doc.get("threads", {}).items():
        text += f"[threads.{name}]\n" + "".join(f'{k} = "{v}"\n' for k, v in table.items())
    path.write_text(text)
    return parse_config(_load(path), str(path))


def _load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def rank_slot(main: tuple[int, ...], **roles: tuple[int, ...]) -> Slot:
    cpus = tuple(sorted(set(main).union(*roles.values())))
    return Slot(cpus, (0,), {"main": main, **roles})


def with_slots(placement: Placement, slots: dict[ProcKey, Slot]) -> Placement:
    ranks = tuple(
        RankPlacement(r.rank, r.device, slots.get(r.rank, r.slot), r.local_rank, r.devices)
        for r in placement.ranks
    )
    engine = slots.get("engine", placement.engine) if placement.engine is not None else None
    return Placement(placement.strategy, engine, ranks, placement.warnings, placement.shared)


def run_with_checker(
    config: Config,
    scenario: Scenario,
    *,
    slots: dict[ProcKey, Slot] | None = None,
    timeout_s: float = 60.0,
) -> Daemon:
    env = dict(os.environ)
    topology, placement = prepare(config, env, FS)
    if slots:
        placement = with_slots(placement, slots)
    stop = asyncio.Event()  # the shutdown trigger
    daemon = Daemon(
        config,
        topology,
        placement,
        env=env,
        fs=FS,
        api=False,
        check_loop=True,
        shutdown_trigger=stop,
    )

    async def main() -> None:
        async with asyncio.timeout(timeout_s):
            task = asyncio.create_task(daemon.run())
            try:
                checker = await until(lambda: daemon.checker)
                await scenario(daemon, checker)
            finally:
                stop.set()  # as SIGTERM would
                assert await task == 0

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    return daemon


def run_checked(
    config: Config,
    scenario: Callable[[CheckHarness], Awaitable[None]],
    *,
    slots: dict[ProcKey, Slot],
    timeout_s: float = 60.0,
) -> None:
    """`scenario` against the check loop alone (tests/support/check_harness.py):
    rank 0's worker command started by the harness, no daemon around it."""
    topology, placement = prepare(config, dict(os.environ), FS)
    placement = with_slots(placement, slots)
    argv = [
        sys.executable if a == "python" else a.replace("{rank}", "0")
        for a in config.workers.command
    ]

    async def main() -> None:
        async with (
            asyncio.timeout(timeout_s),
            checking(config, topology, placement, {0: argv}) as h,
        ):
            await scenario(h)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


async def checks_pass(daemon: Daemon, n: int) -> None:
    """Wait until `n` more check passes have finished."""
    start = daemon.store.snapshot.counters.checks
    await until(lambda: daemon.store.snapshot.counters.checks >= start + n)


def affinity(tid: int) -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(tid)))


def thread_tids(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def comm(pid: int, tid: int) -> str:
    return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()


async def child_report(out: Path, key: str, pid: int, threads: int = 0) -> dict[str, Any]:
    path = out / f"{key}-{pid}.json"

    def ready() -> dict[str, Any] | None:
        if not path.exists():
            return None
        doc: dict[str, Any] = json.loads(path.read_text())
        return doc if len(doc["threads"]) >= threads else None

    report: dict[str, Any] = await until(ready)
    return report


def pid_of(daemon: Daemon, key: ProcKey) -> int:
    pid = daemon.store.snapshot.processes[key].pid
    assert pid is not None
    return pid


def counter(daemon: Daemon, name: str, label: tuple[str, ...]) -> int:
    table: dict[Any, int] = dict(getattr(daemon.store.snapshot.counters, name))
    return table.get(label, 0)


def events(daemon: Daemon, kind: str, key: ProcKey | None = None) -> list[Any]:
    return [
        e for e in daemon.store.snapshot.events if e.kind == kind and (key is None or e.key == key)
    ]


# -- perturbation: enforce and observe ---------------------------------------------------


@pytest.mark.timeout(90)
def test_a_thread_pushed_off_its_cpus_is_put_back_and_counted(tmp_path: Path) -> None:
    script, out = write_child(tmp_path, NAMED_THREADS_CHILD)
    config = config_of(child_doc(script, out, {"threads": ["comm"]}), tmp_path)
    slot = rank_slot((0,), comm=(1,))

    async def scenario(h: CheckHarness) -> None:
        pid = h.pid(0)
        report = await child_report(out, "0", pid, threads=2)
        comm_tid = report["threads"]["comm"]
        # The first checks put every thread on its role: main on 0 (where it
        # started), comm on 1 (a role bind, not drift).
        await until(lambda: affinity(pid) == (0,) and affinity(comm_tid) == (1,))
        await h.checks(2)
        assert h.counter("rebinds", ("0", "thread_role")) >= 1
        assert h.counter("drift_events", ("0", "thread_affinity")) == 0
        # Push the comm thread onto main's CPU from outside.
        os.sched_setaffinity(comm_tid, {0})
        await until(lambda: affinity(comm_tid) == (1,), timeout_s=5)
        await until(lambda: h.counter("rebinds", ("0", "thread_affinity")) == 1)
        assert h.counter("drift_events", ("0", "thread_affinity")) == 1
        drift = h.events("drift", 0)
        assert drift and f"tid {comm_tid}" in drift[-1].fields["targets"]
        assert drift[-1].fields["outcome"] == ["fixed"]
        await h.checks(3)
        # Fixed: counted once, nothing left in the published drift.
        assert h.counter("drift_events", ("0", "thread_affinity")) == 1
        assert h.store.snapshot.drift[0] == ()
        observed = {t.tid: t for t in h.store.snapshot.observed[0].threads}
        assert observed[comm_tid].role == "comm" and observed[comm_tid].cpus == (1,)

    run_checked(config, scenario, slots={0: slot})


@pytest.mark.timeout(90)
def test_under_observe_drift_is_reported_and_left_alone(tmp_path: Path) -> None:
    script, out = write_child(tmp_path, NAMED_THREADS_CHILD)
    doc = child_doc(
        script, out, {"threads": ["comm"]}, drift={"policy": {"thread_affinity": "observe"}}
    )
    config = config_of(doc, tmp_path)
    slot = rank_slot((0,))  # main only: the shim's binding is already right

    async def scenario(h: CheckHarness) -> None:
        pid = h.pid(0)
        report = await child_report(out, "0", pid, threads=2)
        comm_tid = report["threads"]["comm"]
        await h.checks(2)
        assert h.store.snapshot.drift[0] == ()
        os.sched_setaffinity(comm_tid, {1})
        await until(lambda: h.store.snapshot.drift.get(0))
        await h.checks(3)
        (finding,) = h.store.snapshot.drift[0]
        assert finding.kind == "thread_affinity" and finding.target == f"tid {comm_tid}"
        assert finding.action == "observe" and finding.expected == "0" and finding.actual == "1"
        assert affinity(comm_tid) == (1,)  # left alone
        assert h.counter("drift_events", ("0", "thread_affinity")) == 1  # once
        assert h.counter("rebinds", ("0", "thread_affinity")) == 0
        # POST /rebind runs one enforcing pass now, whatever the policy.
        summary = await h.checker.rebind(0)
        assert summary["processes"]["0"]["threads_rebound"] == 1
        assert affinity(comm_tid) == (0,)
        assert h.counter("rebinds", ("0", "api")) == 1
        assert h.store.snapshot.drift[0] == ()

    run_checked(config, scenario, slots={0: slot})


# -- thread roles (issue 4) -----------------------------------------------------------------


@pytest.mark.timeout(90)
def test_late_threads_are_bound_and_pinned_threads_respected(tmp_path: Path) -> None:
    script, out = write_child(tmp_path, NAMED_THREADS_CHILD)
    spec = {"threads": ["release"], "pin": {"name": "pinned", "cpus": [0]}, "late": "comm-late"}
    config = config_of(child_doc(script, out, spec), tmp_path)
    # main spans both CPUs so that a thread can pin itself inside it.
    slot = rank_slot((0, 1), comm=(1,), release=(0,))

    async def scenario(h: CheckHarness) -> None:
        pid = h.pid(0)
        report = await child_report(out, "0", pid, threads=3)
        tids = report["threads"]
        await until(lambda: affinity(tids["release"]) == (0,))
        await h.checks(3)
        assert affinity(tids["pinned"]) == (0,)  # pinned inside main: respected
        assert affinity(tids["main"]) == (0, 1)
        (out / "0.late").touch()
        report = await child_report(out, "0", pid, threads=4)
        late = report["threads"]["comm-late"]
        assert comm(pid, late) == "comm-late"
        await until(lambda: affinity(late) == (1,))  # checks every 0.1 s; a loaded CI box is slow
        assert h.counter("drift_events", ("0", "thread_affinity")) == 0
        assert any(late in e.fields.get("tids", []) for e in h.events("rebind", 0))

    run_checked(config, scenario, slots={0: slot})


@pytest.mark.timeout(90)
def test_enforce_pinned_moves_a_pinned_thread(tmp_path: Path) -> None:
    script, out = write_child(tmp_path, NAMED_THREADS_CHILD)
    spec = {"pin": {"name": "pinned", "cpus": [0]}}
    config = config_of(child_doc(script, out, spec, drift={"enforce_pinned": True}), tmp_path)

    async def scenario(h: CheckHarness) -> None:
        pid = h.pid(0)
        report = await child_report(out, "0", pid, threads=2)
        await until(lambda: affinity(report["threads"]["pinned"]) == (0, 1))

    run_checked(config, scenario, slots={0: rank_slot((0, 1))})


@pytest.mark.timeout(120)
def test_demo_threads_run_on_their_roles(tmp_path: Path) -> None:
    port = free_port()
    doc = to_toml(
        {
            "cpu_ranks": 2,
            "cgroup": "off",
            "stop_timeout_s": 5,
            "engine": {"command": ["python", "-m", "supervisor.demo.engine", "--port", str(port)]},
            "workers": {"command": [*DEMO_WORKER, "--mem-cap-mib", "16"]},
            "ready": {"tcp": f"127.0.0.1:{port}", "timeout_s": 60},
        }
    )
    doc += (
        "[drift]\ncheck_interval_s = 0.2\n"
        '[threads.comm]\nprocess = "workers"\npattern = "comm*"\n'
        '[threads.release]\nprocess = "workers"\npattern = "release*"\n'
    )
    path = tmp_path / "demo.toml"
    path.write_text(doc)
    config = parse_config(_load(path), str(path))
    slots: dict[ProcKey, Slot] = {
        "engine": rank_slot((0,), so_compiler=(1,)),
        0: rank_slot((0,), comm=(1,), release=(0,)),
        1: rank_slot((1,), comm=(0,), release=(1,)),
    }

    def wrong(pid: int, slot: Slot, prefixes: dict[str, str]) -> list[str]:
        bad = []
        for tid in thread_tids(pid):
            name = comm(pid, tid)
            role = next((r for p, r in prefixes.items() if name.startswith(p)), "main")
            if affinity(tid) != slot.role_cpus(role):
                bad.append(f"{tid} {name} {affinity(tid)} != {role} {slot.role_cpus(role)}")
        return bad

    async def scenario(daemon: Daemon, checker: CheckLoop) -> None:
        await until(
            lambda: all(p.state == "running" for p in daemon.store.snapshot.processes.values()), 60
        )
        engine = pid_of(daemon, "engine")
        names = await until(
            lambda: [
                comm(engine, t)
                for t in thread_tids(engine)
                if comm(engine, t).startswith("so-compile")
            ]
        )
        assert names
        checks: list[tuple[int, Slot, dict[str, str]]] = [
            (engine, slots["engine"], {"so-compile": "so_compiler"}),
            (pid_of(daemon, 0), slots[0], {"comm": "comm", "release": "release"}),
            (pid_of(daemon, 1), slots[1], {"comm": "comm", "release": "release"}),
        ]
        for pid, _, _ in checks[1:]:
            await until(
                lambda pid=pid: {"comm", "release"} <= {comm(pid, t) for t in thread_tids(pid)}
            )
        # Corrected by the check loop: within the time after which /healthz calls its
        # checks stale (a few intervals, at least 30 s), not a guess.
        await until(lambda: not any(wrong(*c) for c in checks), timeout_s=checker.stale_after_s)
        await checks_pass(daemon, 2)
        assert not any(wrong(*c) for c in checks)

    run_with_checker(config, scenario, slots=slots, timeout_s=110)


@pytest.mark.timeout(90)
def test_a_refused_bind_is_counted_once_and_isolated(tmp_path: Path) -> None:
    script, out = write_child(tmp_path, NAMED_THREADS_CHILD)
    config = config_of(child_doc(script, out, {"threads": ["comm"]}), tmp_path)
    # comm's CPU does not exist here: sched_setaffinity(2) answers EINVAL.
    missing = max(os.sched_getaffinity(0)) + 64
    slot = Slot((0, missing), (0,), {"main": (0,), "comm": (missing,)})

    async def scenario(h: CheckHarness) -> None:
        pid = h.pid(0)
        report = await child_report(out, "0", pid, threads=2)
        await until(lambda: h.counter("bind_failures", ("0", "thread", "invalid")))
        await h.checks(4)
        assert h.counter("bind_failures", ("0", "thread", "invalid")) == 1  # once
        (finding,) = h.store.snapshot.drift[0]
        assert finding.target == f"tid {report['threads']['comm']}" and finding.action == "failed"
        assert affinity(pid) == (0,)  # the rest of the process is still bound
        assert h.store.snapshot.processes[0].state == "running"
        failed = h.events("bind_failed", 0)
        assert len(failed) == 1 and "EINVAL" in failed[0].message

    run_checked(config, scenario, slots={0: slot})
