"""Start-up and readiness as systemd and a load balancer see them.

A real daemon (`python -m supervisor run`) with a real AF_UNIX datagram socket
as NOTIFY_SOCKET: READY=1 comes once every process is spawned and bound, before
the engine's probe passes; STATUS= shows the wait, then the truth (which
processes failed). The `ready.tcp` probe only accepts a listener of the
engine's own process tree (/proc/<pid>/net/tcp and fd links, read for real).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.config import ReadyProbe
from supervisor.hostfs import HostFS
from supervisor.run.listeners import (
    Listener,
    check_listener_owner,
    parse_listeners,
    serves,
    tree_pids,
)
from supervisor.run.probe import wait_ready
from tests.support.daemon_support import (
    DaemonProcess,
    daemon_env,
    free_port,
    to_toml,
)
from tests.support.poll import poll

FS = HostFS("/")

# An engine that listens on PORT once the file GO exists (a model load that
# ends when the test says so); stays up until TERM.
LOADING_ENGINE = r"""
import os, socket, sys, time
port, go = int(sys.argv[1]), sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.05)
s = socket.socket()
s.bind(("127.0.0.1", port))
s.listen()
while True:
    s.accept()[0].close()
"""

# An engine whose port is taken: bind fails (EADDRINUSE) and it exits 1.
BIND_OR_DIE = r"""
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
time.sleep(600)
"""

LISTENER = r"""
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(60)
"""

# A listener started by the engine's child (not the engine itself): still its tree.
GRANDCHILD_LISTENS = r"""
import subprocess, sys
subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]])
"""


def engine_config(tmp_path: Path, engine: str, *args: str, timeout_s: float = 60) -> Path:
    script = tmp_path / "engine.py"
    script.write_text(engine)
    doc = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 3,
        "engine": {"command": ["python", str(script), *args]},
        "workers": {"command": ["sleep", "600"]},
        "ready": {"tcp": f"127.0.0.1:{args[0]}", "timeout_s": timeout_s},
        "restart": {
            "backoff_initial_s": 0.2,
            "backoff_max_s": 0.5,
            "crash_loop_limit": 3,
            "crash_loop_window_s": 60.0,
        },
        "placement": {"rank_roles": {}},
    }
    path = tmp_path / "c.toml"
    path.write_text(to_toml(doc))
    return path


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(60)
    with contextlib.closing(sock):
        yield sock, path


def recv_until(
    sock: socket.socket, wanted: Callable[[bytes], bool], seen: list[tuple[float, bytes]]
) -> bytes:
    """Datagrams (each kept in `seen` with its arrival time) until one is `wanted`."""
    while True:
        message = sock.recv(4096)
        seen.append((time.monotonic(), message))
        if wanted(message):
            return message


def readyz(daemon: DaemonProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/readyz", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_ready_comes_before_the_engine_is_ready_and_status_shows_the_wait(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    port = free_port()
    go = tmp_path / "go"
    config = engine_config(tmp_path, LOADING_ENGINE, str(port), str(go))
    seen: list[tuple[float, bytes]] = []
    with DaemonProcess(config, tmp_path / "stderr.log", env=daemon_env(NOTIFY_SOCKET=path)) as d:
        ready = recv_until(sock, lambda m: m.startswith(b"READY=1"), seen)
        ready_at = time.monotonic()
        # READY while the engine is loading: spawned and bound, not yet ready.
        assert b"STATUS=0/2 running" in ready and b"not ready" in ready, ready
        doc = poll(d.placement)
        assert doc["engine"]["state"] == "starting" and doc["engine"]["pid"]
        assert doc["engine"]["bound"] is True  # bound before READY
        assert doc["ranks"][0]["state"] == "starting"  # waits for the engine
        assert readyz(d)[0] == 503
        # Progress every few seconds: elapsed time and the timeout.
        waiting = recv_until(sock, lambda m: b"engine loading:" in m, seen)
        assert b"tcp 127.0.0.1:%d not ready after" % port in waiting
        assert b"s of 60s (nothing listens on port %d)" % port in waiting
        go.touch()  # the model is loaded
        recv_until(sock, lambda m: m.startswith(b"STATUS=2/2 running") and b"; ready" in m, seen)
        ready_for_real = seen[-1][0]
        assert ready_at < ready_for_real
        assert readyz(d)[0] == 200
        assert d.stop(timeout_s=30) == 0
    log = (tmp_path / "stderr.log").read_text()
    assert "INFO waiting for readiness rank=engine" in log
    assert "elapsed_s=5 timeout_s=60" in log
    started = log.index("supervisor started")
    assert started < log.index("INFO ready rank=engine")


def test_a_foreign_listener_is_not_the_engines_and_a_failed_engine_is_not_ready(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    # Another program holds the engine's port: every engine start dies on
    # EADDRINUSE, while a plain connect to the port succeeds throughout.
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    config = engine_config(tmp_path, BIND_OR_DIE, str(port))
    seen: list[tuple[float, bytes]] = []
    with (
        contextlib.closing(squatter),
        DaemonProcess(config, tmp_path / "stderr.log", env=daemon_env(NOTIFY_SOCKET=path)) as d,
    ):
        recv_until(sock, lambda m: m.startswith(b"READY=1"), seen)
        failed = recv_until(sock, lambda m: b"failed: engine" in m, seen)
        assert failed.startswith(b"STATUS=0/2 running;") and failed.endswith(b"; not ready")
        doc = poll(d.placement)
        assert doc["engine"]["state"] == "failed"
        assert doc["ranks"][0]["state"] == "stopped"  # never started: the engine is down
        assert d.events("ready") and all(e.get("rank") != "engine" for e in d.events("ready"))
        status, body = readyz(d)
        assert status == 503 and "engine: failed" in body
        with urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        assert 'placement_process_state{rank="engine",state="failed"} 1.0' in metrics
        assert 'placement_up{rank="engine"} 0.0' in metrics
        assert "placement_ready 0.0" in metrics
        assert d.proc.poll() is None  # stays up, degraded
        assert d.stop(timeout_s=30) == 0
    log = (tmp_path / "stderr.log").read_text()
    assert "WARNING exit rank=engine" in log
    assert "WARNING restart scheduled rank=engine" in log
    assert "WARNING degraded status=" in log
    assert "INFO ready rank=engine" not in log


# -- the ownership check on its own ----------------------------------------------------

TCP_TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1
   1: 0100007F:1F40 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 4243 1
   2: 00000000:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4244 1
"""
TCP6_TABLE = (
    "  sl  local_address                         remote_address                        st\n"
    "   0: 00000000000000000000000000000000:1F42 00000000000000000000000000000000:0000 0A "
    "00000000:00000000 00:00000000 00000000     0        0 5151 1\n"
)


@pytest.mark.skipif(sys.byteorder != "little", reason="the table above is an x86/arm64 capture")
def test_parse_listeners_reads_listen_sockets_only() -> None:
    assert parse_listeners(TCP_TABLE) == [
        Listener("127.0.0.1", 8000, 4242),
        Listener("0.0.0.0", 8001, 4244),
    ]
    assert parse_listeners(TCP6_TABLE) == [Listener("::", 8002, 5151)]


def test_serves_matches_the_address_or_a_wildcard() -> None:
    loopback = Listener("127.0.0.1", 8000, 1)
    assert serves(loopback, "127.0.0.1", 8000)
    assert not serves(loopback, "127.0.0.1", 8001)
    assert not serves(loopback, "10.0.0.5", 8000)
    assert serves(Listener("0.0.0.0", 8000, 1), "10.0.0.5", 8000)
    assert serves(Listener("::", 8000, 1), "127.0.0.1", 8000)
    assert serves(Listener("::ffff:127.0.0.1", 8000, 1), "127.0.0.1", 8000)
    assert serves(loopback, "localhost", 8000)  # a name: the port decides


def test_the_owner_check_finds_a_grandchilds_listener_and_refuses_a_strangers() -> None:
    port = free_port()
    # engine -> child that listens: the listener is in the engine's tree.
    engine = subprocess.Popen(
        [sys.executable, "-c", GRANDCHILD_LISTENS, LISTENER, str(port)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # one process group: the listener goes with it
    )
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert engine.stdout is not None
        assert engine.stdout.readline().strip() == "listening"
        assert len(tree_pids(FS, engine.pid)) == 2
        assert check_listener_owner(FS, engine.pid, "127.0.0.1", port) is None
        refused = check_listener_owner(FS, stranger.pid, "127.0.0.1", port)
        assert refused is not None and "outside the engine's tree" in refused
        assert check_listener_owner(FS, engine.pid, "127.0.0.1", free_port()) is not None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.pid, signal.SIGKILL)
        stranger.kill()
        engine.wait()
        stranger.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as nobody")
def test_without_cap_sys_ptrace_the_owner_check_says_why() -> None:
    # The engine as nobody; the checker as root without CAP_SYS_PTRACE (what a
    # unit missing it would give): the fd table is refused, and the message says so.
    port = free_port()
    setpriv = "/usr/bin/setpriv"
    engine = subprocess.Popen(
        [
            *(setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"),
            *("/usr/bin/python3", "-c", LISTENER, str(port)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    check = (
        "import sys; from supervisor.hostfs import HostFS;"
        "from supervisor.run.listeners import check_listener_owner;"
        "print(check_listener_owner(HostFS('/'), int(sys.argv[1]), '127.0.0.1', int(sys.argv[2])))"
    )
    try:
        assert engine.stdout is not None
        assert engine.stdout.readline().strip() == "listening"
        done = subprocess.run(
            [
                *(setpriv, "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace"),
                *(sys.executable, "-c", check, str(engine.pid), str(port)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert done.stdout.strip() == (
            f"cannot read the open files of pid {engine.pid} to see who listens on port "
            f"{port} (another user's process: the supervisor needs CAP_SYS_PTRACE)"
        )
        assert check_listener_owner(FS, engine.pid, "127.0.0.1", port) is None  # with it
    finally:
        engine.kill()
        engine.wait()


# -- a probe that errors is "not ready yet" ----------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to lower another process's RLIMIT_NOFILE")
def test_a_probe_that_errors_for_a_while_is_retried_until_it_passes(tmp_path: Path) -> None:
    # A real transient error: the daemon's RLIMIT_NOFILE lowered from outside
    # (prlimit(2)) to 3, so the ownership check's netlink socket() fails with
    # EMFILE on every attempt; raised back, the same probe passes.
    port = free_port()
    go = tmp_path / "go"
    config = engine_config(tmp_path, LOADING_ENGINE, str(port), str(go), timeout_s=120)
    log_path = tmp_path / "stderr.log"
    with DaemonProcess(config, log_path) as d:
        doc = poll(d.placement, what="the API")
        poll(lambda: (d.placement() or {}).get("engine", {}).get("pid"), what="engine pid")
        limits = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (3, limits[1]))
        try:
            go.touch()  # the engine listens: only the probe's own error stands in the way
            poll(lambda: "ready probe error rank=engine" in d.tail(100_000), what="error logged")
            # Still waiting, past a progress report whose last failure is the error.
            poll(
                lambda: 'last="probe error: OSError: [Errno 24]' in d.tail(100_000),
                timeout_s=30,
                what="a retry after the error",
            )
            assert d.proc.poll() is None
        finally:
            resource.prlimit(d.pid, resource.RLIMIT_NOFILE, limits)
        doc = poll(d.running, timeout_s=30, what="engine and worker running")
        assert doc["engine"]["state"] == "running"
        assert d.events("ready") and not d.events("ready_failed")
        assert d.stop(timeout_s=30) == 0
    log = log_path.read_text()
    assert log.count("ready probe error") == 1, log  # one line, however many attempts
    assert 'error="OSError: [Errno 24] Too many open files"' in log
    assert 'action="retry until timeout"' in log
    assert "INFO ready rank=engine" in log
    assert "supervision error" not in log and "ready probe failed" not in log


def test_a_probe_that_always_errors_times_out_with_the_error_instead_of_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A fixture tree whose /proc/<pid>/net/tcp is a directory: every ownership
    # check raises (SpecialFileError); the wait ends at its timeout, not at once.
    (tmp_path / "proc" / "100" / "net" / "tcp").mkdir(parents=True)
    probe = ReadyProbe(tcp="127.0.0.1:9", timeout_s=0.6)
    with caplog.at_level(logging.WARNING):
        result = asyncio.run(
            wait_ready(probe, lambda: True, 0.05, owner=(HostFS(str(tmp_path)), 100))
        )
    assert not result.ready
    assert result.waited_s >= 0.6
    assert result.detail.startswith("timed out: probe error: SpecialFileError: ")
    assert "not a regular file" in result.detail
    errors = [r.getMessage() for r in caplog.records if "ready probe error" in r.getMessage()]
    assert len(errors) == 1 and "rank=engine" in errors[0], errors
