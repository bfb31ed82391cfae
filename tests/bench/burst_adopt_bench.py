"""Adoption after a burst: an engine forks N children (3,000 by default), then starts
its worker; how long until the daemon adopts the worker, with the proc connector on
and with it off (PLACEMENT_SUPERVISOR_PROC_EVENTS=0, the baseline), and how many of
the engine's children /placement lists meanwhile.

    .venv/bin/python -m tests.bench.burst_adopt_bench [--children 3000] [--repeats 2]

Issue 30: with cgroup.procs read as one page (~700 pids), a tree past ~700
processes was seen once a minute: the worker was adopted after 52.4 s with the
connector on, 0.5 s with it off. Each round is a fresh real daemon (cgroup =
"auto", so the trees live in cgroups and the keeper reads their cgroup.procs);
the clock starts just before the engine's posix_spawn of the worker and stops
at the first /placement (polled every 20 ms) that shows the rank running with
that pid. No absolute number is asserted; the medians and their ratio are
printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

ENGINE = r"""
import json, os, sys, time
ready, report, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
r, w = os.pipe()
for _ in range(n):
    if os.fork() == 0:
        os.close(w)
        os.read(r, 1)  # EOF when the engine is gone: none outlives the round
        os._exit(0)
os.close(r)
env = dict(os.environ, LOCAL_RANK="0")
argv = [sys.executable, "-c", "import time; time.sleep(3600)", "worker"]
t = time.monotonic()
pid = os.posix_spawn(sys.executable, argv, env)
with open(report + ".tmp", "w") as f:
    json.dump({"pid": pid, "t": t}, f)
os.rename(report + ".tmp", report)
open(ready, "w").close()
time.sleep(3600)
"""


def one_round(tmp: Path, children: int, connector: bool, n: int) -> tuple[float, int, int]:
    """(seconds to adoption, children listed then, children listed 5 s later)."""
    d = tmp / f"{'on' if connector else 'off'}-{n}"
    d.mkdir()
    engine = d / "engine.py"
    engine.write_text(ENGINE)
    ready, report = d / "ready", d / "report.json"
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "auto",
        "stop_timeout_s": 5,
        "engine": {"command": ["python", str(engine), str(ready), str(report), str(children)]},
        "ready": {"file": str(ready), "timeout_s": 300},
        "workers": {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
    }
    config = d / "burst.toml"
    config.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 1.0\n")
    extra = {INSTANCE_ENV: f"burst-{os.getpid()}-{n}-{int(connector)}"}
    if not connector:
        extra["PLACEMENT_SUPERVISOR_PROC_EVENTS"] = "0"
    with DaemonProcess(config, d / "d.log", env=daemon_env(**extra)) as daemon:
        poll(report.exists, timeout_s=300, what="the engine's burst and worker")
        spawn = json.loads(report.read_text())
        while True:
            doc_now = daemon.placement()
            rank = (doc_now or {"ranks": [{}]})["ranks"][0]
            if rank.get("pid") == spawn["pid"] and rank.get("state") == "running":
                took = time.monotonic() - spawn["t"]
                break
            if time.monotonic() - spawn["t"] > 300:
                raise SystemExit(f"not adopted in 300 s:\n{daemon.tail()}")
            time.sleep(0.02)
        listed = len((doc_now or {})["engine"].get("children", []))
        time.sleep(5.0)
        later = len((daemon.placement() or {})["engine"].get("children", []))
        daemon.stop(timeout_s=60)
    return took, listed, later


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--children", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("burst_adopt_bench: needs root (the proc connector, cgroups)")
    took: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="burst-bench-") as tmp:
        for n in range(args.repeats):
            for connector in (True, False):  # interleaved: the host's load hits both
                s, listed, later = one_round(Path(tmp), args.children, connector, n)
                took[connector].append(s)
                name = "connector on " if connector else "connector off"
                print(
                    f"{name}: adopted after {s:.2f} s; children listed {listed} then, "
                    f"{later} 5 s later (of {args.children})",
                    flush=True,
                )
    on, off = statistics.median(took[True]), statistics.median(took[False])
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"median adoption after a burst of {args.children}: on {on:.2f} s, off {off:.2f} s")
    print(f"on/off: {on / max(off, 1e-6):.2f}x (issue 30 before the fix: 52.4 s / 0.5 s)")


if __name__ == "__main__":
    main()
