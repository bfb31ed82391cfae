"""What binding buys: a decode-step worker's step times beside a grammar-compiling engine.

    .venv/bin/python -m tests.bench.value_bench [--rounds 6] [--steps 1000]
        [--workers-by engine|daemon] [--plot docs/value_steps.png | --no-plot]

The worker (tests/bench/value_worker.py) runs fixed work per step on its main
thread plus a 1 ms device-like wait, with three helper threads; the engine
(tests/bench/value_engine.py) compiles JSON-schema grammars with real
xgrammar on an unnamed pool it creates itself, as vLLM's structured-output
manager does, and starts the worker as its own child, as vLLM's engine core
does. Every case is one session of its own, as a service or a login shell
starts an engine, so engine and worker share a scheduling group (sched(7),
autogroups) as in a deployment. Four cases, interleaved round by round (the
order rotates):
  alone       the worker by itself, started plainly;
  plain       the engine (and so its worker) started plainly;
  supervised  under a real daemon leading its session (as systemd starts
              one): the engine's worker adopted as rank 0, the engine's pool
              named, capped and bound to the so_compiler CPUs by the start-up
              hook (`[threads.*] executors` lists the engine's module); with
              `--workers-by daemon` the daemon spawns the worker instead, in
              a session of its own (supervisor/run/procs.py);
  numactl     the engine under `numactl --cpunodebind=N --membind=N` on the
              rank's node, the engines' own binding (vLLM's `--numa-bind`).
Prints step p50/p99 per case over all rounds, the ratios against `alone` and
`plain` from the same run, the per-round p99 ratios, each case's sessions
and autogroups, where the supervised case's threads ran, and the load
average; writes a plot of the step-time distributions (matplotlib, the
`test` extra). Asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from supervisor.cpulist import format_cpulist
from tests.support.daemon_support import (
    INSTANCE_ENV,
    REPO,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import wait_until

CASES = ("alone", "plain", "supervised", "numactl")
LABELS = dict(zip(CASES, ("(a) alone", "(b) plain", "(c) supervised", "(d) numactl"), strict=True))
ENGINE = "tests.bench.value_engine"
WORKER = "tests.bench.value_worker"
START_TIMEOUT_S = 240.0  # xgrammar imports torch: many seconds on a loaded 2-core box


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def child_env() -> dict[str, str]:
    env = daemon_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def popen(argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """`argv` leading a session of its own, as a service or a login shell starts an
    engine: every case's processes are one session, apart from this bench's."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            list(argv),
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=f,
            start_new_session=True,
        )


def end_session(proc: subprocess.Popen[bytes]) -> None:
    """KILL the process group `proc` leads (the engine and its worker), then reap it.
    Only while `proc` is unreaped: until then its pid, the group's id, is not reused."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def sched_group(pid: int) -> str:
    """`sid=S autogroup-N nice=K`: where the scheduler groups `pid` (sched(7): with
    sched_autogroup_enabled, each session is one group for tasks in the root cpu
    cgroup, and groups get equal shares whatever their thread counts)."""
    try:
        sid = os.getsid(pid)
        with open(f"/proc/{pid}/autogroup") as f:
            group = f.read().split()[0].lstrip("/")
        nice = os.getpriority(os.PRIO_PROCESS, pid)
    except OSError as err:
        return f"unreadable ({err.strerror})"
    return f"sid={sid} {group} nice={nice}"


def autogroups_enabled() -> str:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip()
    except OSError:
        return "absent"


def await_file(path: Path, procs: Sequence[subprocess.Popen[bytes]], what: str) -> None:
    def there() -> bool:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"{what}: a process exited early (logs in {path.parent})")
        return path.exists()

    if not wait_until(there, START_TIMEOUT_S, 0.02):
        raise SystemExit(f"{what}: {path.name} not within {START_TIMEOUT_S}s")


def read_steps(out: Path, what: str) -> list[float]:
    path = out / "steps.json"
    if not wait_until(path.exists, START_TIMEOUT_S, 0.05):
        raise SystemExit(f"{what}: no steps.json")
    steps: list[float] = json.loads(path.read_text())
    return steps


def worker_argv(out: Path, work: int, steps: int) -> list[str]:
    return [sys.executable, "-m", WORKER, str(out), str(work), str(steps)]


def worker_pid(out: Path) -> int:
    return int((out / "worker.armed").read_text())


def plain_case(
    out: Path, work: int, steps: int, *, engine: bool, prefix: Sequence[str], seen: dict[str, str]
) -> list[float]:
    """One session started by this process, under `prefix`: the worker alone, or
    the engine with the worker as its child (as vLLM's engine core starts workers)."""
    worker = worker_argv(out, work, steps)
    if engine:
        argv = [*prefix, sys.executable, "-m", ENGINE, str(out), *worker]
    else:
        argv = [*prefix, *worker]
    proc = popen(argv, out / "session.log")
    try:
        if engine:
            await_file(out / "engine.ready", [proc], "engine")
        await_file(out / "worker.armed", [proc], "worker")
        groups = [f"worker {sched_group(worker_pid(out))}"]
        if engine:
            groups.insert(0, f"engine {sched_group(proc.pid)}")
        (out / "go").touch()
        seen["groups"] = ", ".join(groups)
        return read_steps(out, "worker")
    finally:
        end_session(proc)


def supervised_config(out: Path, work: int, steps: int, workers_by: str) -> Path:
    engine = ["python", "-m", ENGINE, str(out)]
    worker = ["python", "-m", WORKER, str(out), str(work), str(steps)]
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "auto",
        "stop_timeout_s": 3,
        "ready": {"file": str(out / "engine.ready"), "timeout_s": START_TIMEOUT_S},
        "restart": {"policy": "never"},
        # One rank, its slot's CPUs all `main`; the engine's so_compiler role
        # asked for apart. On a 2-CPU node the planner merges the engine's
        # roles into one CPU, the one the rank does not have (see placement()).
        "placement": {"rank_roles": {}, "on_shortage": "share"},
    }
    if workers_by == "engine":
        # vLLM's shape: the engine starts its worker, the daemon adopts it
        # (docs/contracts.md section 6); engine and worker share one session.
        doc["engine"] = {"command": [*engine, *worker], "kind": "custom"}
        doc["workers"] = {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]}
    else:
        # The daemon starts both, each in a session of its own (run/procs.py).
        doc["engine"] = {"command": engine}
        doc["workers"] = {"command": worker}
    text = to_toml(doc)
    text += "[placement.engine]\nmain_cpus = 1\nroles = { so_compiler = 1 }\n"
    text += '[threads.so_pools]\nprocess = "engine"\nrole = "so_compiler"\n'
    text += f'executors = ["{ENGINE}"]\n'
    path = out / "value.toml"
    path.write_text(text)
    return path


def thread_cpus(pid: int, prefix: str = "") -> dict[str, set[int]]:
    """{comm: CPUs} of `pid`'s threads whose comm starts with `prefix` (union per comm)."""
    out: dict[str, set[int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
            cpus = os.sched_getaffinity(int(tid))
        except OSError:
            continue
        if comm.startswith(prefix):
            out.setdefault(comm, set()).update(cpus)
    return out


def supervised_case(
    out: Path, work: int, steps: int, workers_by: str, seen: dict[str, str]
) -> list[float]:
    """The daemon leading a session of its own, as systemd starts a service."""
    config = supervised_config(out, work, steps, workers_by)
    env = child_env()
    env[INSTANCE_ENV] = f"value-bench-{os.getpid()}-{out.name}"
    daemon = DaemonProcess(config, out / "daemon.log", env=env, new_session=True)
    try:

        def up() -> dict[str, Any] | None:
            doc = daemon.running()
            if not doc or not (out / "worker.armed").exists():
                return None
            rank = doc["ranks"][0]
            if rank.get("pid") != worker_pid(out):
                return None  # not yet adopted
            bound = set().union(*thread_cpus(rank["pid"]).values())
            return doc if bound and bound <= set(rank["cpus"]) else None

        doc = wait_until(up, START_TIMEOUT_S, 0.05)
        if not doc:
            raise SystemExit(f"supervised: not running:\n{daemon.tail()}")
        rank, engine = doc["ranks"][0], doc["engine"]
        seen["groups"] = (
            f"daemon {sched_group(daemon.pid)}, engine {sched_group(engine['pid'])}, "
            f"worker {sched_group(rank['pid'])}"
        )
        (out / "go").touch()
        time.sleep(0.5)  # sample the threads mid-run (a reading, not a synchronisation)
        pools = thread_cpus(engine["pid"], "so_compiler")
        worker = set().union(*thread_cpus(rank["pid"]).values())
        seen["plan"] = (
            f"rank cpus {format_cpulist(rank['cpus'])}, engine cpus "
            f"{format_cpulist(engine['cpus'])}, warnings: {'; '.join(doc.get('warnings', []))}"
        )
        seen["threads"] = (
            f"worker threads on {format_cpulist(sorted(worker))}; engine pool threads "
            + ", ".join(f"{k} on {format_cpulist(sorted(v))}" for k, v in sorted(pools.items()))
        )
        return read_steps(out, "supervised")
    finally:
        daemon.stop(30)


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def plot(path: Path, results: dict[str, list[float]], title: str) -> None:
    import matplotlib  # noqa: PLC0415 - the test extra; only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    for case in CASES:
        ms = sorted(v * 1e3 for v in results[case])
        share = [1 - (i + 0.5) / len(ms) for i in range(len(ms))]
        p99 = pct(ms, 0.99)
        ax.step(ms, share, where="post", label=f"{LABELS[case]}: p99 {p99:.1f} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1e-3, 1)
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("share of steps slower")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def ratios(values: Sequence[float], bases: Sequence[float]) -> str:
    return ",".join(f"{v / b:.2f}" for v, b in zip(values, bases, strict=True))


def summary(results: dict[str, list[float]], per_round: dict[str, list[float]]) -> None:
    """p50/p99 over all rounds, against `alone` and `plain`; the per-round p99 ratios."""
    alone = {q: pct(results["alone"], q) for q in (0.5, 0.99)}
    plain_p99 = pct(results["plain"], 0.99)
    head = ("p50 ms", "p99 ms", "p50/alone", "p99/alone", "p99/plain")
    print("\n" + f"{'case':<11}" + "".join(f"{h:>10}" for h in head))
    for case in CASES:
        p50, p99 = pct(results[case], 0.5), pct(results[case], 0.99)
        row = (p50 * 1e3, p99 * 1e3, p50 / alone[0.5], p99 / alone[0.99], p99 / plain_p99)
        print(f"{case:<11}" + "".join(f"{v:10.2f}" for v in row))
    for base in ("alone", "plain"):
        shown = "; ".join(
            f"{c} {ratios(per_round[c], per_round[base])}" for c in CASES if c != base
        )
        print(f"per-round p99 / that round's {base}: {shown}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument(
        "--work", type=int, default=40000, help="step_work iterations per step (~2 ms quiet)"
    )
    parser.add_argument(
        "--workers-by",
        choices=("engine", "daemon"),
        default="engine",
        help="supervised: the engine starts the worker and the daemon adopts it (vLLM's "
        "shape, the default), or the daemon spawns it (its own session)",
    )
    parser.add_argument("--plot", type=Path, default=REPO / "docs/value_steps.png")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401, PLC0415 - checked before minutes of measuring
        except ImportError:
            raise SystemExit(
                "the plot needs matplotlib: pip install -e '.[test]', or --no-plot"
            ) from None
    node = 0  # the rank's node: the only one on the machines this runs on in CI
    numactl = ["numactl", f"--cpunodebind={node}", f"--membind={node}"]
    work = args.work
    loads = [load()]
    print(
        f"value bench: {args.rounds} rounds x {args.steps} steps, work {work} iterations, "
        f"supervised workers started by the {args.workers_by}"
    )
    print(
        f"cpus {format_cpulist(sorted(os.sched_getaffinity(0)))}, "
        f"sched_autogroup_enabled {autogroups_enabled()}, load average {loads[0]}"
    )
    results: dict[str, list[float]] = {c: [] for c in CASES}
    per_round: dict[str, list[float]] = {c: [] for c in CASES}
    seen: dict[str, str] = {}
    groups: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="value-bench-") as tmp:
        for r in range(args.rounds):
            order = CASES[r % len(CASES) :] + CASES[: r % len(CASES)]
            for case in order:
                out = Path(tmp) / f"{r}-{case}"
                out.mkdir()
                if case == "supervised":
                    steps = supervised_case(out, work, args.steps, args.workers_by, seen)
                else:
                    engine = case != "alone"
                    prefix = numactl if case == "numactl" else []
                    steps = plain_case(
                        out, work, args.steps, engine=engine, prefix=prefix, seen=seen
                    )
                groups.setdefault(case, seen.pop("groups", "?"))
                results[case].extend(steps)
                per_round[case].append(pct(steps, 0.99))
            loads.append(load())
            print(
                f"round {r + 1}: load {loads[-1]}, p99 ms "
                + " ".join(f"{c}={per_round[c][-1] * 1e3:.1f}" for c in CASES),
                flush=True,
            )
    summary(results, per_round)
    for case in CASES:
        print(f"{case} scheduling groups (round 1): {groups.get(case, '?')}")
    for key in ("plan", "threads"):
        print(f"supervised {key}: {seen.get(key, '?')}")
    print(f"load average (1, 5, 15 min) per round: {' | '.join(loads)}")
    if not args.no_plot:
        title = (
            f"worker step times, {args.rounds} interleaved rounds x {args.steps} steps, 2 CPUs; "
            f"load {loads[0].split()[0]}-{max(float(x.split()[0]) for x in loads):.1f}"
        )
        plot(args.plot, results, title)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
