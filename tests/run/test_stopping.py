"""A process between TERM and its exit is `stopping`, with a real daemon.

`python -m supervisor run` supervises two workers that hold on after TERM
until the test releases them (as an engine draining its requests would); a
POST /ranks/1/restart sends rank 1 its TERM. While it holds, /readyz is 503,
placement_ready 0, /placement, `status` and the log say stopping; once it
exits and its successor runs, /readyz is 200 again. Everything is read from
outside: the API over TCP and its unix socket, the CLI, the log file.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from supervisor.listen import parse_listen
from supervisor.serve.status import http_request
from tests.support.daemon_support import (
    REPO,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

# Holds on after TERM until `release` exists (its handler's installation and the
# TERM's arrival each left in a file).
WORKER = """
import os, signal, sys, time
out, rank = sys.argv[1], sys.argv[2]
termed = []
def on_term(signum, frame):
    termed.append(1)
    open(os.path.join(out, f"term-{rank}-{os.getpid()}"), "w").close()
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(out, f"up-{rank}-{os.getpid()}"), "w").close()  # holds from here
while not (termed and os.path.exists(os.path.join(out, "release"))):
    time.sleep(0.05)
"""
STOP_TIMEOUT_S = 120  # never reached: the worker is released long before


def _config(tmp_path: Path) -> tuple[Path, Path, Path]:
    out = tmp_path / "out"
    out.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    sock = tmp_path / "api.sock"
    doc: dict[str, Any] = {
        "cpu_ranks": 2,
        "cgroup": "off",
        "stop_timeout_s": STOP_TIMEOUT_S,
        "workers": {"command": ["python", str(worker), str(out), "{rank}"]},
        "placement": {"rank_roles": {}, "engine": {"enabled": False}},
        "irq": {"enabled": False},
        "api": {"unix_socket": str(sock)},
    }
    path = tmp_path / "stopping.toml"
    path.write_text(to_toml(doc))
    return path, out, sock


def _get(d: DaemonProcess, path: str) -> tuple[int, bytes]:
    code, _, body = http_request(parse_listen(f"127.0.0.1:{d.port}"), "GET", path)
    return code, body


def _ready(d: DaemonProcess) -> bool:
    try:
        return _get(d, "/readyz")[0] == 200
    except OSError:
        return False


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    assert match is not None, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def _status(d: DaemonProcess) -> tuple[int, str]:
    import subprocess  # noqa: PLC0415

    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--listen", f"127.0.0.1:{d.port}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_a_rank_between_term_and_exit_is_stopping_and_not_ready(tmp_path: Path) -> None:
    config, out, sock = _config(tmp_path)
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as d:
        first = poll(d.running, timeout_s=60, what="both workers running")
        poll(lambda: _ready(d), timeout_s=30, what="/readyz 200")
        old_pid = first["ranks"][1]["pid"]
        poll((out / f"up-1-{old_pid}").exists, timeout_s=30, what="rank 1's TERM handler")

        code, _, body = http_request(parse_listen(f"unix:{sock}"), "POST", "/ranks/1/restart")
        assert code == 200, body
        term = out / f"term-1-{old_pid}"
        poll(term.exists, timeout_s=30, what="rank 1's TERM")

        # Rank 1 holds on after its TERM: on its way out, so not ready.
        code, body = _get(d, "/readyz")
        assert code == 503, body
        assert "1: stopping" in json.loads(body)["reasons"]
        _, metrics = _get(d, "/metrics")
        text = metrics.decode()
        assert _metric(text, "placement_ready") == 0.0
        assert _metric(text, "placement_process_state", '{rank="1",state="stopping"}') == 1.0
        assert _metric(text, "placement_process_state", '{rank="1",state="running"}') == 0.0
        assert _metric(text, "placement_up", '{rank="1"}') == 0.0
        doc = d.placement()
        assert doc is not None
        assert doc["ranks"][1]["state"] == "stopping" and doc["ranks"][1]["pid"] == old_pid
        assert doc["ranks"][0]["state"] == "running"
        code, shown = _status(d)
        assert code == 4, shown  # answered, not ready
        assert "1: stopping" in shown, shown
        log = d.tail(20000)
        assert "rank=1" in log and "why=restart" in log, log
        not_ready = [line for line in log.splitlines() if "not ready status=" in line]
        assert not_ready and "stopping: rank 1" in not_ready[-1], log

        # Released: it exits, its successor runs bound, and only then ready again.
        (out / "release").touch()
        poll(lambda: _ready(d), timeout_s=60, what="/readyz 200 again")
        doc = d.placement()
        assert doc is not None
        rank1 = doc["ranks"][1]
        assert rank1["state"] == "running" and rank1["bound"] and rank1["pid"] != old_pid
        assert "ready status=" in d.tail(20000).split("not ready status=")[-1]
        code = d.stop(timeout_s=60)
    assert code == 0, d.tail()
