"""The real daemon under API abuse: idle connections past its fd limit, a flood of bad requests.

`python -m supervisor run` runs under `prlimit --nofile=256:256` (prlimit
sets the limit and execs the daemon: same pid, no preexec_fn) with more
idle connections than the limit; its worker is SIGKILLed and must come
back. The flood sends 2,000 requests with a 9 KB header over raw sockets.
Everything is read from outside: sockets, /proc, the API, the log file.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.hostfs import HostFS
from supervisor.procfs.stat import read_proc_stat
from tests.support.daemon_support import (
    REPO,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

FS = HostFS("/")
FD_LIMIT = 256
IDLE_CONNECTIONS = 300  # more than the daemon's whole fd limit
WORKER_MARK = "http-daemon-test-worker"
BAD_REQUEST = b"GET /placement HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 9000 + b"\r\n\r\n"
FLOOD = 2000
LOG_BUDGET_BYTES = 20_000


def write_config(tmp_path: Path) -> Path:
    doc: dict[str, Any] = {
        "cpu_ranks": 2,
        "cgroup": "off",
        "stop_timeout_s": 3,
        "workers": {
            "command": ["python", "-c", "import signal; signal.pause()", WORKER_MARK, "{rank}"]
        },
        "restart": {
            "backoff_initial_s": 0.2,
            "backoff_max_s": 1.0,
            "crash_loop_limit": 3,
            "crash_loop_window_s": 60.0,
        },
        "placement": {"rank_roles": {}, "engine": {"enabled": False}},
        "irq": {"enabled": False},
    }
    path = tmp_path / "http.toml"
    path.write_text(to_toml(doc))
    return path


def fd_count(pid: int) -> int:
    return len(FS.listdir(f"proc/{pid}/fd"))


def workers_of(daemon_pid: int) -> set[int]:
    found = set()
    for name in FS.listdir("proc"):
        if not name.isdigit():
            continue
        stat = read_proc_stat(FS, int(name))
        if stat is None or stat.ppid != daemon_pid or stat.state in ("Z", "X"):
            continue
        try:
            cmdline = FS.read_text(f"proc/{name}/cmdline")
        except OSError:
            continue
        if WORKER_MARK in cmdline:
            found.add(stat.pid)
    return found


def answered(sock: socket.socket) -> bool:
    """Something (an answer or EOF) is waiting on `sock`, without consuming it."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def metric(daemon: DaemonProcess, line_start: str) -> float | None:
    try:
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            _, _, body = read_response(sock)
    except OSError:
        return None
    for line in body.decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def test_a_daemon_at_its_fd_limit_respawns_a_killed_worker_and_stops_clean(
    tmp_path: Path, held: list[socket.socket]
) -> None:
    prefix = ["prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", "--"]
    config = write_config(tmp_path)
    with DaemonProcess(config, tmp_path / "daemon.log", env=daemon_env(), prefix=prefix) as daemon:
        doc = poll(daemon.running, timeout_s=60, what="both ranks running")
        victim = next(r["pid"] for r in doc["ranks"] if r["rank"] == 0)
        baseline = fd_count(daemon.pid)
        for _ in range(IDLE_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
            held.append(sock)

        found = re.search(r"api listening .* max_connections=(\d+)", daemon.tail(100_000))
        cap = int(found.group(1)) if found else FD_LIMIT
        assert cap + baseline < FD_LIMIT  # the cap leaves the daemon fds of its own

        def settled() -> bool:
            # All over the cap were closed (the oldest idle ones, for the newer);
            # or the daemon is out of fds (what happened before there was a cap).
            closed = sum(answered(s) for s in held)
            return closed >= IDLE_CONNECTIONS - cap or fd_count(daemon.pid) >= FD_LIMIT - 2

        poll(settled, timeout_s=30, what="every idle connection held or closed")
        assert fd_count(daemon.pid) < FD_LIMIT - 2
        # A new client (a liveness probe) is answered: an idle one makes room.
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status, headers, body = read_response(sock)
        assert status == 200 and headers["content-type"] == "application/json"
        assert json.loads(body)["status"] == 200

        os.kill(victim, signal.SIGKILL)

        def respawned_or_down() -> bool:
            return bool(workers_of(daemon.pid) - {victim}) and len(workers_of(daemon.pid)) == 2

        poll(respawned_or_down, timeout_s=30, what="rank 0 respawned while the API is full")
        for sock in held:
            sock.close()
        held.clear()

        def running_again() -> dict[str, Any] | None:
            now = daemon.running()
            if now and next(r["pid"] for r in now["ranks"] if r["rank"] == 0) != victim:
                return now
            return None

        poll(running_again, timeout_s=30, what="rank 0 running again with a new pid")
        code = daemon.stop()
        log = daemon.log.read_text(errors="replace")
    shed = [int(n) for n in re.findall(r"connections_shed=(\d+)", log)]
    assert sum(shed) >= IDLE_CONNECTIONS - cap, log[-4000:]
    assert code == 0, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert f"fd limit soft_before={FD_LIMIT} soft={FD_LIMIT} hard={FD_LIMIT}" in log
    assert "api max_connections lowered asked=256" in log


def test_a_flood_of_oversized_headers_costs_counters_not_log(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    with DaemonProcess(config, tmp_path / "daemon.log", env=daemon_env()) as daemon:
        poll(daemon.running, timeout_s=60, what="both ranks running")
        before = daemon.log.stat().st_size
        statuses: dict[int, int] = {}
        for _ in range(FLOOD):
            with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
                sock.sendall(BAD_REQUEST)
                status, headers, body = read_response(sock)
            assert headers["content-type"] == "application/json", headers
            assert json.loads(body)["status"] == status
            statuses[status] = statuses.get(status, 0) + 1
        assert statuses == {431: FLOOD}
        counted = metric(daemon, 'placement_http_bad_requests_total{reason="headers_too_large"}')
        assert counted == FLOOD
        grown = daemon.log.stat().st_size - before
        assert daemon.stop() == 0
        log = daemon.log.read_text(errors="replace")
    assert grown < LOG_BUDGET_BYTES, log[-4000:]
    assert "Traceback" not in log
    assert f"count={FLOOD} reasons=headers_too_large:{FLOOD}" in log  # the stop's summary


# Fills every fd of its own process, then runs the sampler: it must log and go on.
SAMPLER_UNDER_EMFILE = """
import asyncio, logging, os, resource, sys
from supervisor.serve.usage import self_usage_loop

class Store:
    samples = 0
    def update(self, **changes):
        Store.samples += 1

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

async def main():
    fds = []
    try:
        while True:
            fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    task = asyncio.create_task(self_usage_loop(Store(), 0.01))
    for _ in range(500):
        await asyncio.sleep(0.01)
        if task.done():
            break
    full = Store.samples
    for fd in fds:
        os.close(fd)
    for _ in range(500):
        await asyncio.sleep(0.01)
        if task.done() or Store.samples > full:
            break
    if task.done():
        print(repr(task.exception()), file=sys.stderr)
    print("done" if task.done() else "alive", full, Store.samples)
    task.cancel()

asyncio.run(main())
"""


def test_the_self_usage_sampler_survives_running_out_of_fds() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SAMPLER_UNDER_EMFILE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    state, full, total = result.stdout.split()
    assert state == "alive", result.stderr
    assert int(full) == 0 and int(total) > 0  # no sample while full, samples again after
    assert "self usage read failed" in result.stderr
    assert "Too many open files" in result.stderr
