"""Fork-storm benchmark: the daemon's CPU while its engine's tree forks and execs
short-lived processes by the hundred a second, beside its quiet cost, in one run.

    .venv/bin/python -m tests.bench.fork_storm_bench [--rate 1000] [--window-s 10] [--repeats 2]

A real daemon runs an engine (`[workers] spawned_by = "engine"`, `rank_from =
["env:LOCAL_RANK"]`, one adopted rank, checks every 1 s) that, once told,
posix_spawns `sleep 0.00N` (N = 1..10 ms, what tokenizers, compile workers
and `nvidia-smi` calls look like) at `--rate` a second. The daemon's
utime+stime over the window (all its threads), as % of one core:
quiet (no storm), storm with the proc connector, and storm with the connector
off (PLACEMENT_SUPERVISOR_PROC_EVENTS=0, checks only), interleaved `--repeats`
times; the storm's achieved rate is printed too. Target: the connector's
storm cost at most 2% of a core at 1,000/s. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from supervisor.hostfs import HostFS
from supervisor.procfs.stat import read_proc_stat
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

FS = HostFS("/")
CLK_TCK = os.sysconf("SC_CLK_TCK")

# The engine: one long-lived worker (LOCAL_RANK=0), then, while the `go` file
# exists, short-lived children at the given rate; it writes how many it made.
ENGINE = r"""
import os, sys, time
ready, go, count_path, rate = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
env = {**os.environ, "LOCAL_RANK": "0"}
os.posix_spawn(sys.executable, [sys.executable, "-c", "import time; time.sleep(3600)"], env)
storm_env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
open(ready, "w").close()
sleep = "/bin/sleep"
made = 0
while True:
    if not os.path.exists(go):
        time.sleep(0.05)
        continue
    start = time.monotonic()
    made = 0
    while os.path.exists(go):
        due = start + made / rate
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        os.posix_spawn(sleep, [sleep, f"0.00{made % 10}"], storm_env)
        made += 1
        while True:  # reap what has ended (no zombies pile up)
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
    with open(count_path, "w") as f:
        f.write(f"{made} {time.monotonic() - start}")
"""


def cpu_seconds(pid: int) -> float:
    stat = read_proc_stat(FS, pid)
    assert stat is not None, f"daemon {pid} is gone"
    return (stat.utime_ticks + stat.stime_ticks) / CLK_TCK


class Storm:
    def __init__(self, tmp: Path, rate: float, connector: bool) -> None:
        self.dir = tmp / ("on" if connector else "off")
        self.dir.mkdir()
        engine = self.dir / "engine.py"
        engine.write_text(ENGINE)
        self.ready, self.go, self.count = (self.dir / n for n in ("ready", "go", "count"))
        doc: dict[str, Any] = {
            "cpu_ranks": 1,
            "cgroup": "auto",
            "stop_timeout_s": 3,
            "engine": {
                "command": [
                    "python",
                    str(engine),
                    str(self.ready),
                    str(self.go),
                    str(self.count),
                    str(rate),
                ]
            },
            "ready": {"file": str(self.ready), "timeout_s": 60},
            "workers": {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]},
            "placement": {"rank_roles": {}, "on_shortage": "share"},
        }
        config = self.dir / "storm.toml"
        config.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 1.0\n")
        extra = {INSTANCE_ENV: f"storm-{'on' if connector else 'off'}-{os.getpid()}"}
        if not connector:
            extra["PLACEMENT_SUPERVISOR_PROC_EVENTS"] = "0"
        self.daemon = DaemonProcess(config, self.dir / "d.log", env=daemon_env(**extra))
        poll(self._adopted, timeout_s=90, what="the rank adopted")

    def engine_args(self, rate: float) -> tuple[object, ...]:
        return (self.ready, self.go, self.count, rate)

    def _adopted(self) -> bool:
        doc = self.daemon.placement()
        return bool(doc) and doc["ranks"][0]["state"] == "running"  # type: ignore[index]

    def window(self, window_s: float, *, storm: bool) -> tuple[float, float]:
        """(% of a core the daemon used, the storm's achieved rate per second)."""
        self.count.unlink(missing_ok=True)
        if storm:
            self.go.touch()
            time.sleep(1.0)  # the storm is up to speed
        before, t0 = cpu_seconds(self.daemon.pid), time.monotonic()
        time.sleep(window_s)
        used, took = cpu_seconds(self.daemon.pid) - before, time.monotonic() - t0
        rate = 0.0
        if storm:
            self.go.unlink()
            poll(self.count.exists, timeout_s=10, what="the storm count")
            made, secs = self.count.read_text().split()
            rate = int(made) / float(secs)
        return 100 * used / took, rate

    def close(self) -> None:
        self.go.unlink(missing_ok=True)
        self.daemon.stop(timeout_s=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("fork_storm_bench: needs root (the proc connector, cgroups)")
    results: dict[str, list[float]] = {"quiet": [], "storm": [], "storm-noconn": []}
    rates: list[float] = []
    with tempfile.TemporaryDirectory(prefix="storm-bench-") as tmp:
        on = Storm(Path(tmp), args.rate, connector=True)
        off = Storm(Path(tmp), args.rate, connector=False)
        try:
            for _ in range(args.repeats):
                results["quiet"].append(on.window(args.window_s, storm=False)[0])
                cpu, rate = on.window(args.window_s, storm=True)
                results["storm"].append(cpu)
                rates.append(rate)
                results["storm-noconn"].append(off.window(args.window_s, storm=True)[0])
        finally:
            on.close()
            off.close()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"storm rate achieved: {statistics.median(rates):.0f}/s (asked {args.rate:.0f}/s)")
    for name, values in results.items():
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:13s} daemon CPU {med[name]:6.2f}% of a core  ({each})")
    print(
        f"storm/quiet: {med['storm'] / max(med['quiet'], 1e-6):.1f}x; "
        f"storm - quiet: {med['storm'] - med['quiet']:.2f} points (target <= 2%)"
    )


if __name__ == "__main__":
    main()
