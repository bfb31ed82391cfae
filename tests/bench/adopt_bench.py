"""Adoption benchmark: fork/exec to bound, with the proc connector and with polling only;
the daemon's CPU with adopted ranks and a thread-creating pool.

    .venv/bin/python -m tests.bench.adopt_bench [--rounds 30] [--cpu-window-s 20]
        [--repeats 3] [--base CHECKOUT] [--cpu-only] [--thread-names] [--profile DIR]

`--base` runs an earlier commit's daemon (a `git worktree add --detach`
checkout) alternately with this one's, in the same run, and prints this/base;
`--thread-names` sets each daemon thread's OS name in a bench-only wrapper
(Python 3.11 leaves them all "python") and prints CPU per thread over the
window (ps-loop, ps-tree, ps-proc, ps-adopt); `--profile` adds a cProfile per
thread. The daemon itself has no switch for any of this.

1. Latency. A real daemon runs a launcher as its engine (`[workers]
   spawned_by = "engine"`, `rank_from = ["env:LOCAL_RANK"]`, checks every
   1 s); then, with no rank_from, as `[engine] kind = "vllm"` (-tp 2) and
   `"sglang"` (--tp 2): the worker sets its title with the real setproctitle
   (`VLLM::Worker_TP<r>`, `sglang::scheduler_TP<r>`) and the clock starts at
   the title (target: p99 <= 50 ms after it). On each round the launcher
   posix_spawns a worker with LOCAL_RANK set and reports the CLOCK_MONOTONIC
   time just before; this process then
   samples every thread's affinity (sched_getaffinity per tid) until all are
   on the rank's planned CPUs. p50/p99 of (bound - spawn), once with the proc
   connector and once with PLACEMENT_SUPERVISOR_PROC_EVENTS=0 (polling at
   each check), and their ratio. Target: p99 <= 50 ms with the connector.
2. CPU. 8 adopted ranks x 100 threads, one of them also creating and ending
   500 threads/s; the daemon's utime+stime over a window as % of one core,
   with and without the connector. Target: < 1% at 1 s checks.
No absolute number is asserted; the figures and ratios are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from supervisor.hostfs import HostFS
from supervisor.procfs.stat import parse_proc_stat, read_proc_stat
from tests.support.daemon_support import (
    INSTANCE_ENV,
    REPO,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import wait_until

FS = HostFS("/")
CLK_TCK = os.sysconf("SC_CLK_TCK")

LAUNCHER = r"""
import json, os, socket, sys, time
ctl_path, report_path, ready, worker = sys.argv[1:5]
ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
ctl.bind(ctl_path)
out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
open(ready, "w").close()
while True:
    msg = json.loads(ctl.recv(4096))
    if msg["op"] == "spawn":
        env = dict(os.environ, LOCAL_RANK=str(msg["rank"]))
        argv = [sys.executable, worker, *map(str, msg["args"])]
        t = time.monotonic()
        pid = os.posix_spawn(sys.executable, argv, env)
        out.sendto(json.dumps({"pid": pid, "t": t}).encode(), report_path)
    elif msg["op"] == "kill":
        os.kill(msg["pid"], 9)
        os.waitpid(msg["pid"], 0)
        out.sendto(b"{}", report_path)
"""

WORKER = r"""
import sys, threading, time
threads, churn_per_s = int(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) > 4:
    # Titled as the engine titles its rank process; the clock starts at the title.
    import json, socket, setproctitle
    title, report = sys.argv[3:5]
    t = time.monotonic()
    setproctitle.setproctitle(title)
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    out.sendto(json.dumps({"title_t": t}).encode(), report)
for _ in range(threads):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
if churn_per_s:
    # A pool that keeps creating short-lived threads (xgrammar's per-compile threads).
    period = 1.0 / churn_per_s
    while True:
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        time.sleep(period)
time.sleep(3600)
"""


WRAPPER = r"""
# Runs the daemon in this process with each thread's OS name set to its Python
# name (prctl PR_SET_NAME; Python 3.11 leaves them all "python"), so that
# /proc/<pid>/task/<tid>/stat tells them apart; with OUT, also a cProfile per
# thread, dumped to OUT/<thread>.prof at exit. The daemon's code comes from CODE.
import ctypes, os, runpy, sys, threading
out, code = sys.argv[1:3]
sys.path.insert(0, code)  # the supervisor package to run (this repository's, or --base's)
sys.argv = ["supervisor", *sys.argv[6:]]  # drop: this script, OUT, CODE, python, -m supervisor
libc = ctypes.CDLL(None)
def name(text):
    libc.prctl(15, ctypes.c_char_p(text.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
profiles = {}
def start(frame, event, arg):
    thread = threading.current_thread().name
    name(thread)
    if out:
        import cProfile
        p = profiles[thread] = cProfile.Profile()
        p.enable()  # replaces this hook for the thread
    else:
        sys.setprofile(None)
threading.setprofile(start)
name("ps-loop")
if out:
    import cProfile
    profiles["main"] = cProfile.Profile()
    profiles["main"].enable()
try:
    runpy.run_module("supervisor", run_name="__main__", alter_sys=True)
finally:
    for thread, p in profiles.items():
        p.dump_stats(f"{out}/{thread}.prof")
"""


class Bench:
    """A daemon with a launcher engine, driven over a unix datagram socket."""

    def __init__(
        self,
        tmp: Path,
        ranks: int,
        connector: bool,
        name: str,
        *,
        thread_names: bool = False,
        profile: Path | None = None,
        code: Path | None = None,
        layout: str | None = None,
    ) -> None:
        self.layout = layout
        self.tmp = tmp / name
        self.tmp.mkdir()
        launcher, worker = self.tmp / "launcher.py", self.tmp / "worker.py"
        launcher.write_text(LAUNCHER)
        worker.write_text(WORKER)
        self.ctl_path = str(self.tmp / "ctl.sock")
        self.report = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.report.bind(str(self.tmp / "report.sock"))
        self.report.settimeout(30)
        ready = self.tmp / "ready"
        doc: dict[str, Any] = {
            "cpu_ranks": ranks,
            "cgroup": "auto",
            "stop_timeout_s": 2,
            "engine": {
                "command": [
                    "python",
                    str(launcher),
                    self.ctl_path,
                    str(self.tmp / "report.sock"),
                    str(ready),
                    str(worker),
                ]
            },
            "ready": {"file": str(ready), "timeout_s": 60},
            "workers": {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]},
        }
        if layout is not None:
            # No rank_from: the kind's rules name the titled worker (LAYOUTS).
            doc["engine"]["kind"] = layout
            doc["engine"]["command"] += LAYOUTS[layout][0]
            doc["workers"] = {"spawned_by": "engine"}
        doc |= {"placement": {"rank_roles": {}, "on_shortage": "share"}}
        config = self.tmp / "bench.toml"
        config.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 1.0\n")
        env = daemon_env(**{INSTANCE_ENV: f"adopt-bench-{name}-{os.getpid()}"})
        if not connector:
            env["PLACEMENT_SUPERVISOR_PROC_EVENTS"] = "0"
        prefix: list[str] = []
        if thread_names or profile is not None or code is not None:
            (self.tmp / "wrapper.py").write_text(WRAPPER)
            out = ""
            if profile is not None:
                (profile / name).mkdir(parents=True, exist_ok=True)
                out = str(profile / name)
            where = str(code or REPO)
            prefix = [sys.executable, str(self.tmp / "wrapper.py"), out, where]
        self.daemon = DaemonProcess(config, self.tmp / "daemon.log", env=env, prefix=prefix)
        self.ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        doc_ = wait_until(self._engine_running, 60)
        if not doc_:
            raise SystemExit(f"engine not running:\n{self.daemon.tail()}")
        self.planned = {r["rank"]: frozenset(r["cpus"]) for r in doc_["ranks"]}

    def _engine_running(self) -> dict[str, Any] | None:
        doc = self.daemon.placement()
        ok = doc and doc["engine"]["state"] == "running" and os.path.exists(self.ctl_path)
        return doc if ok else None

    def send(self, **msg: Any) -> dict[str, Any]:
        self.ctl.sendto(json.dumps(msg).encode(), self.ctl_path)
        reply: dict[str, Any] = json.loads(self.report.recv(4096))
        return reply

    def rank_state(self, rank: int) -> str:
        doc = self.daemon.placement() or {"ranks": []}
        return next((r["state"] for r in doc["ranks"] if r["rank"] == rank), "?")

    def close(self) -> None:
        self.daemon.stop(30)
        self.report.close()
        self.ctl.close()


def all_threads_on(pid: int, cpus: frozenset[int]) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    try:
        return all(frozenset(os.sched_getaffinity(int(t))) == cpus for t in tids)
    except OSError:
        return False


# The engine flags (appended to the launcher's command) and the title of local
# rank r, as vLLM (WorkerProc, TP 2) and SGLang (run_scheduler_process, --tp 2) set them.
LAYOUTS = {
    "vllm": (["--tensor-parallel-size", "2"], "VLLM::Worker_TP{rank}"),
    "sglang": (["--tp", "2"], "sglang::scheduler_TP{rank}"),
}


def latency_rounds(bench: Bench, rounds: int) -> list[float]:
    out: list[float] = []
    ranks = sorted(bench.planned)
    for i in range(rounds):
        rank = ranks[i % len(ranks)]
        if not wait_until(lambda r=rank: bench.rank_state(r) == "waiting", 30, 0.01):
            raise SystemExit(f"rank {rank} not waiting:\n{bench.daemon.tail()}")
        args: list[Any] = [4, 0]
        if bench.layout is not None:
            args += [LAYOUTS[bench.layout][1].format(rank=rank), str(bench.tmp / "report.sock")]
        spawned = bench.send(op="spawn", rank=rank, args=args)
        pid, t0 = spawned["pid"], spawned["t"]
        if bench.layout is not None:
            t0 = json.loads(bench.report.recv(4096))["title_t"]  # from the title on
        want = bench.planned[rank]
        deadline = time.monotonic() + 10
        while not all_threads_on(pid, want) and time.monotonic() < deadline:
            time.sleep(0.0005)
        out.append(time.monotonic() - t0)
        bench.send(op="kill", pid=pid)
    return out


def cpu_seconds(pid: int) -> float:
    stat = read_proc_stat(FS, pid)
    return 0.0 if stat is None else (stat.utime_ticks + stat.stime_ticks) / CLK_TCK


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of `pid` (threads of one name summed: ps-proc_0, _1...)."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        text = FS.read_optional(f"proc/{pid}/task/{tid}/stat")  # the thread's own times
        stat = parse_proc_stat(text) if text else None
        if stat is not None:
            name = stat.comm.rstrip("0123456789").rstrip("_") or stat.comm
            out[name] = out.get(name, 0.0) + (stat.utime_ticks + stat.stime_ticks) / CLK_TCK
    return out


def cpu_window(bench: Bench, window_s: float) -> float:
    pids = []
    for rank in sorted(bench.planned):
        churn = 500 if rank == 0 else 0
        pids.append(bench.send(op="spawn", rank=rank, args=[100, churn])["pid"])
    wait_until(lambda: all(bench.rank_state(r) == "running" for r in bench.planned), 60, 0.1)
    time.sleep(3)  # the first binds of 800 threads are start-up, not steady state
    before = cpu_seconds(bench.daemon.pid)
    threads_before = thread_cpu(bench.daemon.pid)
    time.sleep(window_s)
    used = cpu_seconds(bench.daemon.pid) - before
    threads_after = thread_cpu(bench.daemon.pid)
    per_thread = {
        name: 100.0 * (spent - threads_before.get(name, 0.0)) / window_s
        for name, spent in threads_after.items()
    }
    print(
        "  per thread (% of a core): "
        + "  ".join(f"{n}={v:.2f}" for n, v in sorted(per_thread.items(), key=lambda i: -i[1]))
    )
    for pid in pids:
        bench.send(op="kill", pid=pid)
    return 100.0 * used / window_s


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--polling-rounds", type=int, default=12)
    parser.add_argument("--cpu-window-s", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=1, help="CPU windows per daemon and mode")
    parser.add_argument("--cpu-only", action="store_true", help="skip the latency rounds")
    parser.add_argument(
        "--base",
        type=Path,
        help="a checkout of an earlier commit: its daemon runs alternately with this one's",
    )
    parser.add_argument(
        "--thread-names", action="store_true", help="name the daemon's OS threads (per-thread CPU)"
    )
    parser.add_argument(
        "--profile", type=Path, help="write a cProfile per daemon thread of the CPU runs here"
    )
    args = parser.parse_args()
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if os.geteuid() != 0:
        print("note: not root: no proc connector, no cgroups; both runs poll", file=sys.stderr)
    codes: list[tuple[str, Path | None]] = [("this", None)]
    if args.base is not None:
        codes.append(("base", args.base.resolve()))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, code in codes if not args.cpu_only else ():
            for name, connector, rounds, layout in (
                ("connector", True, args.rounds, None),
                ("polling", False, args.polling_rounds, None),
                ("vllm_title", True, args.rounds, "vllm"),
                ("sglang_title", True, args.rounds, "sglang"),
            ):
                if layout is not None and code is not None:
                    continue  # the base checkout may have no engine kinds
                bench = Bench(
                    Path(tmp), 2, connector, f"lat-{label}-{name}", code=code, layout=layout
                )
                try:
                    ms = [s * 1000 for s in latency_rounds(bench, rounds)]
                finally:
                    bench.close()
                key = name if label == "this" else f"{label}_{name}"
                results[key] = {"p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99), "n": len(ms)}
                print(
                    f"fork/exec -> all threads on rank CPUs [{label} {name}]: "
                    f"p50 {pct(ms, 0.5):.1f} ms  p99 {pct(ms, 0.99):.1f} ms  "
                    f"mean {statistics.fmean(ms):.1f} ms  n={len(ms)}"
                )
        c, p = results.get("connector"), results.get("polling")
        if c and p:
            print(
                f"polling / connector: p50 x{p['p50_ms'] / c['p50_ms']:.1f}, "
                f"p99 x{p['p99_ms'] / c['p99_ms']:.1f}; "
                f"connector p99 {c['p99_ms']:.1f} ms vs target 50 ms "
                f"({'met' if c['p99_ms'] <= 50 else 'missed'})"
            )
        for name in ("vllm_title", "sglang_title"):
            t = results.get(name)
            if t and c:
                print(
                    f"{name} (title -> bound, named by the kind's rules): p99 {t['p99_ms']:.1f} ms "
                    f"vs env:LOCAL_RANK from spawn x{t['p99_ms'] / c['p99_ms']:.2f}; target 50 ms "
                    f"({'met' if t['p99_ms'] <= 50 else 'missed'})"
                )
        cpu: dict[str, list[float]] = {}
        for i in range(args.repeats):
            for label, code in codes:
                for name, connector in (("connector", True), ("polling", False)):
                    bench = Bench(
                        Path(tmp),
                        8,
                        connector,
                        f"cpu-{label}-{name}-{i}",
                        thread_names=args.thread_names,
                        profile=args.profile,
                        code=code,
                    )
                    try:
                        used = cpu_window(bench, args.cpu_window_s)
                    finally:
                        bench.close()
                    key = f"cpu_{name}_pct" if label == "this" else f"cpu_{label}_{name}_pct"
                    cpu.setdefault(key, []).append(used)
                    print(
                        f"daemon CPU, 8 adopted ranks x 100 threads + 500 threads/s, 1 s checks "
                        f"[{label} {name}]: {used:.2f}% of a core (target < 1%)  "
                        f"load {os.getloadavg()[0]:.2f}"
                    )
        results.update({key: statistics.median(values) for key, values in cpu.items()})
        print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        ratio = results["cpu_connector_pct"] / max(results["cpu_polling_pct"], 1e-9)
        print(f"connector / polling daemon CPU: x{ratio:.2f}")
        if args.base is not None:
            for name in ("connector", "polling"):
                this, base = results[f"cpu_{name}_pct"], results[f"cpu_base_{name}_pct"]
                print(
                    f"daemon CPU [{name}], median of {args.repeats}: this {this:.2f}% "
                    f"base {base:.2f}%  this / base x{this / max(base, 1e-9):.2f}"
                )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
