"""Benchmark: what a flood of malformed API requests costs the daemon, against good requests.

    .venv/bin/python -m tests.bench.http_abuse_bench [--requests 2000] [--rounds 4]

A real daemon (`python -m supervisor run`, two sleeping ranks, no cgroups,
no IRQs) serves its API on loopback. One client sends `--requests`
requests per case, each on a fresh connection over a raw socket:

- bad: `GET /placement` with a 9 KB header line (answered 431 by the parser),
- good: `GET /healthz` with `Connection: close` (answered 200 by the route).

The cases alternate in rounds (ABBA), so a load change on this shared
machine hits both alike. Measured per case: the daemon's CPU time (utime +
stime of /proc/<pid>/stat before and after), the wall time, and how much its
log grew. Printed: each case, the bad/good CPU ratio, the daemon's share of
one core during the flood, and the log bytes per 1,000 bad requests.
Target (issue 17): 2,000 bad requests under 20 kB of log and a small
fraction of a core. No absolute numbers are asserted.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor.hostfs import HostFS
from supervisor.run.procs import read_proc_stat
from tests.support.daemon_support import (
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

FS = HostFS("/")
CLK_TCK = os.sysconf("SC_CLK_TCK")
BAD = b"GET /placement HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 9000 + b"\r\n\r\n"
GOOD = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
LOG_BUDGET_BYTES = 20_000  # for 2,000 bad requests


@dataclass
class Tally:
    requests: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    log_bytes: int = 0
    statuses: dict[int, int] | None = None


def cpu_s(pid: int) -> float:
    stat = read_proc_stat(FS, pid)
    assert stat is not None, f"daemon {pid} is gone"
    return (stat.utime_ticks + stat.stime_ticks) / CLK_TCK


def one(port: int, request: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head = b"".join(chunks).split(b"\r\n", 1)[0]
    return int(head.split()[1])


def run_case(daemon: DaemonProcess, request: bytes, n: int, tally: Tally) -> None:
    statuses = tally.statuses if tally.statuses is not None else {}
    log_before = daemon.log.stat().st_size
    cpu_before, wall_before = cpu_s(daemon.pid), time.monotonic()
    for _ in range(n):
        code = one(daemon.port, request)
        statuses[code] = statuses.get(code, 0) + 1
    tally.wall_s += time.monotonic() - wall_before
    tally.cpu_s += cpu_s(daemon.pid) - cpu_before
    tally.log_bytes += daemon.log.stat().st_size - log_before
    tally.requests += n
    tally.statuses = statuses


def write_config(tmp: Path) -> Path:
    doc = {
        "cpu_ranks": 2,
        "cgroup": "off",
        "stop_timeout_s": 3,
        "workers": {"command": ["python", "-c", "import signal; signal.pause()", "{rank}"]},
        "placement": {"rank_roles": {}, "engine": {"enabled": False}},
        "irq": {"enabled": False},
    }
    path = tmp / "bench.toml"
    path.write_text(to_toml(doc))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="per case")
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds the cases split into")
    args = parser.parse_args(argv)
    per_round = max(1, args.requests // args.rounds)
    bad, good = Tally(), Tally()
    with tempfile.TemporaryDirectory(prefix="http-abuse-bench-") as tmp:
        config = write_config(Path(tmp))
        with DaemonProcess(config, Path(tmp) / "daemon.log", env=daemon_env()) as daemon:
            poll(daemon.running, timeout_s=60, what="the daemon's ranks running")
            run_case(daemon, GOOD, 50, Tally())  # warm-up: imports, caches
            for r in range(args.rounds):
                order = ((BAD, bad), (GOOD, good)) if r % 2 == 0 else ((GOOD, good), (BAD, bad))
                for request, tally in order:
                    run_case(daemon, request, per_round, tally)
            code = daemon.stop()
    print(f"daemon exit status: {code}")
    for name, t in (("bad (9 KB header)", bad), ("good (GET /healthz)", good)):
        print(
            f"{name:22s} requests={t.requests} statuses={t.statuses} "
            f"daemon_cpu_s={t.cpu_s:.3f} wall_s={t.wall_s:.3f} "
            f"cpu_per_request_ms={1000 * t.cpu_s / max(1, t.requests):.3f} "
            f"log_bytes={t.log_bytes}"
        )
    ratio = bad.cpu_s / good.cpu_s if good.cpu_s else float("inf")
    print(f"bad/good daemon CPU ratio: {ratio:.2f}")
    print(f"daemon share of one core during the flood: {bad.cpu_s / max(bad.wall_s, 1e-9):.1%}")
    per_2000 = bad.log_bytes * 2000 / max(1, bad.requests)
    verdict = "ok" if per_2000 < LOG_BUDGET_BYTES else "OVER"
    print(f"log bytes per 2,000 bad requests: {per_2000:.0f} (under {LOG_BUDGET_BYTES}: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
