"""The daemon as a real command: the demo, signals, systemd notification, bad configs.

`python -m supervisor run ...` runs as a subprocess; the tests look at it
only from outside: its API (`GET /placement`), /proc, its exit code, its
stderr, and a real AF_UNIX datagram socket standing in for systemd.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.cpulist import format_cpulist
from supervisor.hostfs import HostFS
from supervisor.procs import read_proc_stat
from tests.daemon_support import child_config, free_port, poll, to_toml, write_child

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "supervisor/demo/demo.toml"
FS = HostFS("/")


def daemon_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
        env.pop(name, None)
    # Our own cgroup instance dir, apart from any other supervisor on this host.
    env["PLACEMENT_SUPERVISOR_INSTANCE"] = f"test-{os.getpid()}"
    env.update(extra)
    return env


def start(
    config: Path, listen: str, env: dict[str, str], stderr: Any = subprocess.PIPE
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor", "run", "--config", str(config), "--listen", listen],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


def get_placement(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/placement", timeout=2) as resp:
            doc: dict[str, Any] = json.load(resp)
            return doc
    except OSError:
        return None


def entries(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = [doc["engine"]] if doc.get("engine") else []
    return out + list(doc["ranks"])


def all_running(port: int) -> dict[str, Any] | None:
    doc = get_placement(port)
    if doc and all(e["state"] == "running" and e["pid"] for e in entries(doc)):
        return doc
    return None


def planned_main_thread_cpus(entry: dict[str, Any]) -> set[str]:
    """The main thread starts on the whole slot (the shim's binding) and the
    check loop then narrows it to the `main` role: either is as planned."""
    return {format_cpulist(entry["cpus"]), format_cpulist(entry["roles"]["main"])}


def cpus_allowed(pid: int) -> str:
    for line in FS.read_text(f"proc/{pid}/status").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise KeyError(pid)


def ours(daemon_pid: int, pgids: set[int]) -> list[int]:
    """Live or zombie processes whose parent is the daemon or whose group is a child's."""
    found = []
    for name in FS.listdir("proc"):
        if not name.isdigit():
            continue
        stat = read_proc_stat(FS, int(name))
        if stat is not None and (stat.ppid == daemon_pid or stat.pgid in pgids):
            found.append(stat.pid)
    return found


def gone(pid: int) -> bool:
    stat = read_proc_stat(FS, pid)
    return stat is None or stat.state in ("Z", "X")


@pytest.fixture
def proc_cleanup() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_demo_comes_up_recovers_a_killed_worker_and_stops_clean(
    proc_cleanup: list[subprocess.Popen[bytes]],
) -> None:
    port = free_port()
    daemon = start(DEMO, f"127.0.0.1:{port}", daemon_env())
    proc_cleanup.append(daemon)
    doc = poll(lambda: all_running(port) or daemon.poll() is not None, timeout_s=60)
    assert daemon.poll() is None, daemon.stderr.read().decode() if daemon.stderr else ""
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    pids = {e["pid"] for e in entries(doc)}
    for e in entries(doc):
        assert cpus_allowed(e["pid"]) in planned_main_thread_cpus(e)
        assert e["mempolicy"]["step"] == "bind"
    assert doc["warnings"], "a 2-CPU box shares CPUs and must say so"

    # SIGKILL a worker: it comes back (new pid) with the same planned affinity.
    victim = doc["ranks"][0]
    os.kill(victim["pid"], signal.SIGKILL)

    def replaced() -> dict[str, Any] | None:
        now = all_running(port)
        return now if now and now["ranks"][0]["pid"] != victim["pid"] else None

    after = poll(replaced, timeout_s=30)
    new = after["ranks"][0]
    assert new["restarts"] == 1
    assert cpus_allowed(new["pid"]) in planned_main_thread_cpus(victim)
    pids |= {e["pid"] for e in entries(after)}

    daemon.send_signal(signal.SIGTERM)
    _, err = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, err.decode()
    log = err.decode()
    assert "plan rank" in log  # the plan table
    assert f"spawn rank=0 pid={new['pid']}" in log
    assert ours(daemon.pid, pids) == []
    assert all(gone(pid) for pid in pids)


def test_sigkill_of_the_supervisor_takes_its_children_along(
    tmp_path: Path, proc_cleanup: list[subprocess.Popen[bytes]]
) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(to_toml(child_config(script, out, engine=True)))
    port = free_port()
    daemon = start(config, f"127.0.0.1:{port}", daemon_env(), stderr=subprocess.DEVNULL)
    proc_cleanup.append(daemon)
    doc = poll(lambda: all_running(port), timeout_s=60)
    pids = [e["pid"] for e in entries(doc)]
    daemon.kill()
    daemon.wait()
    # PR_SET_PDEATHSIG, set by the shim before exec, sends each child SIGTERM.
    poll(lambda: all(gone(pid) for pid in pids), timeout_s=20)


def test_sd_notify_ready_watchdog_stopping_and_journal_lines(
    tmp_path: Path, proc_cleanup: list[subprocess.Popen[bytes]]
) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(to_toml(child_config(script, out)))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = str(tmp_path / "notify.sock")
    notify.bind(notify_path)
    notify.settimeout(30)
    log_path = tmp_path / "stderr.log"
    with open(log_path, "wb") as log_file:
        st = os.fstat(log_file.fileno())
        env = daemon_env(
            NOTIFY_SOCKET=notify_path,
            WATCHDOG_USEC="400000",  # WATCHDOG=1 every 0.2 s
            JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}",
        )
        port = free_port()
        daemon = start(config, f"127.0.0.1:{port}", env, stderr=log_file)
    proc_cleanup.append(daemon)
    try:
        ready = recv_until(notify, lambda m: m.startswith(b"READY=1"))
        assert b"STATUS=2/2 running" in ready  # every process started and bound first
        recv_until(notify, lambda m: m == b"WATCHDOG=1")
        recv_until(notify, lambda m: m == b"WATCHDOG=1")
        # STATUS= follows state changes: a killed worker, then its restart.
        doc = poll(lambda: all_running(port))
        os.kill(doc["ranks"][0]["pid"], signal.SIGKILL)
        recv_until(notify, lambda m: m.startswith(b"STATUS=1/2 running"))
        recv_until(notify, lambda m: m.startswith(b"STATUS=2/2 running"))
        daemon.send_signal(signal.SIGTERM)
        recv_until(notify, lambda m: m.startswith(b"STOPPING=1"))
        assert daemon.wait(timeout=30) == 0
    finally:
        notify.close()
    lines = log_path.read_text().splitlines()
    spawn = [line for line in lines if line.startswith("<6>spawn rank=0 pid=")]
    assert spawn and "mempolicy=bind" in spawn[0]
    # Every line has a syslog priority prefix and no timestamp: journald adds its own.
    assert lines and all(line[:3] in ("<3>", "<4>", "<6>") for line in lines)
    assert not any(line[3:7].isdigit() for line in lines)
    # The children never see the daemon's systemd variables.
    for path in out.glob("*.json"):
        env = json.loads(path.read_text())["env"]
        assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env


def recv_until(sock: socket.socket, wanted: Callable[[bytes], bool]) -> bytes:
    """Datagrams until one is `wanted` (the socket's timeout bounds each wait)."""
    while True:
        message = sock.recv(4096)
        if wanted(message):
            return message


@pytest.mark.parametrize(
    ("doc", "named"),
    [
        ({"restart": {"backoff_max_s": "soon"}}, "restart.backoff_max_s"),
        ({"workers": {"command": ["w", "{gpu}"]}}, "workers.command"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_a_bad_config_exits_2_naming_the_key(
    tmp_path: Path, doc: dict[str, Any], named: str
) -> None:
    full = {"workers": {"command": ["w"]}, **doc}
    config = tmp_path / "bad.toml"
    config.write_text(to_toml(full))
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "run", "--config", str(config)],
        cwd=REPO,
        env=daemon_env(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    err = result.stderr.decode()
    assert named in err and str(config) in err
    assert "Traceback" not in err


def test_a_bad_listen_exits_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "run", "--config", str(DEMO), "--listen", "nope"],
        cwd=REPO,
        env=daemon_env(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "nope" in result.stderr.decode()
