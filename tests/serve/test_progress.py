"""Progress while the engine loads (/readyz, /placement, `status`, `status --watch`), the
hint of a plain `status` that finds no daemon, and `run --log-level`: a real daemon whose
engine listens only when the test says so, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon_support import (
    REPO,
    DaemonProcess,
    daemon_env,
    free_port,
    run_supervisor,
    to_toml,
)
from tests.support.poll import poll

# Listens on its port once the file GO exists (an engine loading its model until then).
ENGINE = """
import os, socket, sys, time
port, go = int(sys.argv[1]), sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.05)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen()
time.sleep(3600)
"""


def readyz(port: int) -> tuple[int, dict[str, Any]]:
    """GET /readyz: (status, document), 503 included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except OSError:  # not listening yet
        return 0, {}


@pytest.fixture(scope="module")
def loading(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, Path, int]]:
    """A daemon (at --log-level warning) whose engine loads until the test creates GO."""
    tmp = tmp_path_factory.mktemp("loading")
    (tmp / "engine.py").write_text(ENGINE)
    engine_port = free_port()
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 2,
        "engine": {
            "command": ["python", str(tmp / "engine.py"), str(engine_port), str(tmp / "GO")]
        },
        "ready": {"tcp": f"127.0.0.1:{engine_port}", "timeout_s": 120},
        "workers": {"command": ["python", "-c", "import time; time.sleep(3600)", "{rank}"]},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
        "irq": {"enabled": False},
    }
    config = tmp / "loading.toml"
    config.write_text(to_toml(doc))
    with DaemonProcess(
        config, tmp / "d.log", env=daemon_env(), args=["--log-level", "warning"]
    ) as daemon:
        yield daemon, tmp, engine_port


def _loading_reason(port: int) -> dict[str, Any] | None:
    code, doc = readyz(port)
    engine = next((p for p in doc.get("processes", ()) if p["process"] == "engine"), None)
    loading = engine and engine.get("loading")
    if code == 503 and loading and loading["last"] and loading["elapsed_s"] >= 1:
        return doc
    return None


def test_readyz_placement_and_status_show_the_engine_loading(
    loading: tuple[DaemonProcess, Path, int],
) -> None:
    daemon, _, engine_port = loading
    doc = poll(lambda: _loading_reason(daemon.port), timeout_s=30, what="engine loading >= 1 s")
    engine = next(p for p in doc["processes"] if p["process"] == "engine")
    assert engine["state"] == "starting"
    probe = f"tcp 127.0.0.1:{engine_port}"
    assert engine["loading"]["probe"] == probe and engine["loading"]["timeout_s"] == 120
    # the last attempt's result: nothing listens yet
    assert engine["loading"]["last"] == f"nothing listens on port {engine_port}", engine
    reason = next(r for r in doc["reasons"] if r.startswith("engine: "))
    assert re.fullmatch(rf"engine: loading \d+s of 120s, {probe}: .+", reason), reason
    # the worker waits for the engine, and says for how long
    worker = next(p for p in doc["processes"] if p["process"] == "0")
    assert worker["state"] in ("waiting", "starting") and worker["down_s"] >= 1, worker
    assert engine["down_s"] >= 1 and engine["loading"]["elapsed_s"] <= engine["down_s"] + 1
    placement = daemon.placement()
    assert placement is not None and placement["engine"]["loading"]["probe"] == probe
    proc = run_supervisor("status", "--listen", f"127.0.0.1:{daemon.port}")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("engine ")]
    assert re.search(r"loading\(\d+s/120s\)", row), proc.stdout
    (worker_row,) = [line for line in proc.stdout.splitlines() if line.startswith("0 ")]
    assert re.search(r" (waiting|starting)\(\d+s\) ", worker_row), proc.stdout
    assert "not ready: engine: loading " in proc.stdout and probe in proc.stdout, proc.stdout


_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def test_status_watch_redraws_until_interrupted(
    loading: tuple[DaemonProcess, Path, int],
) -> None:
    daemon, tmp, _ = loading
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    listen = f"127.0.0.1:{daemon.port}"
    command = [sys.executable, "-m", "supervisor", "status", "--watch", "0.2", "--listen", listen]
    watch = subprocess.Popen(
        # As typed at a terminal, where Ctrl-C's SIGINT is not ignored: a suite run
        # in the background (`.ci/run &`: POSIX shells ignore SIGINT and SIGQUIT in
        # asynchronous commands) hands that down, and Python then never installs
        # its KeyboardInterrupt handler. exec keeps the default the trampoline sets.
        [sys.executable, "-c", _DEFAULT_SIGINT, *command],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert watch.stdout is not None
    try:
        frames = 0
        for line in watch.stdout:  # frames while it loads, then the engine is let go
            frames += line.startswith("every 0.2s: ")
            if frames == 3:
                (tmp / "GO").touch()
            if frames > 3 and line.startswith("engine ") and " running " in f"{line} ":
                break
        watch.send_signal(signal.SIGINT)
        try:
            _, err = watch.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Say what the process was doing (SigIgn, SigCgt, where it sleeps).
            proc = f"/proc/{watch.pid}"
            state = []
            for name in ("status", "wchan", "stack"):
                with contextlib.suppress(OSError):
                    state.append(Path(f"{proc}/{name}").read_text())
            pytest.fail(f"status --watch did not end on SIGINT within 60 s: {state}")
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert frames > 3
    assert watch.returncode == 130 and "Traceback" not in err, err
    # once ready, the loading is gone from /readyz
    _, doc = poll(lambda: (r := readyz(daemon.port))[0] == 200 and r, 60, what="ready")
    assert all(p["loading"] is None for p in doc["processes"]), doc


def test_log_level_warning_keeps_info_lines_out(
    loading: tuple[DaemonProcess, Path, int],
) -> None:
    daemon, _, _ = loading
    poll(daemon.running, timeout_s=60, what="every process running")
    log = daemon.tail(100_000)
    assert " INFO " not in log, log[-3000:]


def test_plain_status_without_a_daemon_says_to_give_config_or_listen() -> None:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 9477)) == 0:
            pytest.skip("something listens on the default address 127.0.0.1:9477")
    proc = run_supervisor("status")
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert "cannot reach the daemon at 127.0.0.1:9477" in line
    assert "--config FILE" in line and "--listen" in line, line
