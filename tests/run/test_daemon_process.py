"""The daemon as a real command: the demo, signals, systemd notification, bad configs.

`python -m supervisor run ...` runs as a subprocess; the tests look at it
only from outside: its API (`GET /placement`), /proc, its exit code, its
stderr, and a real AF_UNIX datagram socket standing in for systemd.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.cpulist import format_cpulist
from supervisor.hostfs import HostFS
from supervisor.procfs.stat import read_proc_stat
from tests.support.children import status_field, write_child
from tests.support.daemon_support import (
    REPO,
    DaemonProcess,
    child_config,
    daemon_env,
    entries,
    run_supervisor,
    to_toml,
)
from tests.support.poll import poll

DEMO = REPO / "supervisor/demo/demo.toml"
FS = HostFS("/")


def planned_main_thread_cpus(entry: dict[str, Any]) -> set[str]:
    """The main thread starts on the whole slot (the shim's binding) and the
    check loop then narrows it to the `main` role: either is as planned."""
    return {format_cpulist(entry["cpus"]), format_cpulist(entry["roles"]["main"])}


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


def test_the_demo_comes_up_recovers_a_killed_worker_and_stops_clean(tmp_path: Path) -> None:
    with DaemonProcess(DEMO, tmp_path / "stderr.log", env=daemon_env()) as daemon:
        # running() fails with the daemon's stderr should it exit instead.
        doc = poll(daemon.running, timeout_s=60)
        assert [r["rank"] for r in doc["ranks"]] == [0, 1]
        pids = {e["pid"] for e in entries(doc)}
        for e in entries(doc):
            assert status_field(e["pid"], "Cpus_allowed_list") in planned_main_thread_cpus(e)
            assert e["mempolicy"]["step"] == "bind"
        assert doc["warnings"], "a 2-CPU box shares CPUs and must say so"

        # SIGKILL a worker: it comes back (new pid) with the same planned affinity.
        victim = doc["ranks"][0]
        os.kill(victim["pid"], signal.SIGKILL)

        def replaced() -> dict[str, Any] | None:
            now = daemon.running()
            return now if now and now["ranks"][0]["pid"] != victim["pid"] else None

        after = poll(replaced, timeout_s=30)
        new = after["ranks"][0]
        assert new["restarts"] == 1
        assert status_field(new["pid"], "Cpus_allowed_list") in planned_main_thread_cpus(victim)
        pids |= {e["pid"] for e in entries(after)}

        code = daemon.stop(timeout_s=60)
        log = daemon.log.read_text()
        assert code == 0, log
        assert "plan rank" in log  # the plan table
        assert f"spawn rank=0 pid={new['pid']}" in log
        assert ours(daemon.pid, pids) == []
        assert all(gone(pid) for pid in pids)


def test_sigkill_of_the_supervisor_takes_its_children_along(tmp_path: Path) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(to_toml(child_config(script, out, engine=True)))
    with DaemonProcess(config, tmp_path / "stderr.log", env=daemon_env()) as daemon:
        doc = poll(daemon.running, timeout_s=60)
        pids = [e["pid"] for e in entries(doc)]
        daemon.proc.kill()
        daemon.proc.wait()
    # PR_SET_PDEATHSIG, set by the shim before exec, sends each child SIGKILL.
    poll(lambda: all(gone(pid) for pid in pids), timeout_s=20)


def test_sd_notify_ready_watchdog_stopping_and_journal_lines(tmp_path: Path) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(to_toml(child_config(script, out)))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = str(tmp_path / "notify.sock")
    notify.bind(notify_path)
    notify.settimeout(30)
    log_path = tmp_path / "stderr.log"
    log_path.touch()  # DaemonProcess reopens it: same inode, the daemon's stderr
    st = log_path.stat()
    env = daemon_env(
        NOTIFY_SOCKET=notify_path,
        WATCHDOG_USEC="400000",  # WATCHDOG=1 every 0.2 s
        JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}",
    )
    with DaemonProcess(config, log_path, env=env) as daemon, contextlib.closing(notify):
        ready = recv_until(notify, lambda m: m.startswith(b"READY=1"))
        assert b"STATUS=2/2 running" in ready  # every process started and bound first
        recv_until(notify, lambda m: m == b"WATCHDOG=1")
        recv_until(notify, lambda m: m == b"WATCHDOG=1")
        # STATUS= follows state changes: a killed worker, then its restart.
        doc = poll(daemon.running)
        os.kill(doc["ranks"][0]["pid"], signal.SIGKILL)
        recv_until(notify, lambda m: m.startswith(b"STATUS=1/2 running"))
        recv_until(notify, lambda m: m.startswith(b"STATUS=2/2 running"))
        daemon.proc.send_signal(signal.SIGTERM)
        recv_until(notify, lambda m: m.startswith(b"STOPPING=1"))
        assert daemon.proc.wait(timeout=30) == 0
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
    result = run_supervisor("run", "--config", str(config), env=daemon_env())
    assert result.returncode == 2
    err = result.stderr
    assert named in err and str(config) in err
    assert "Traceback" not in err


def test_a_bad_listen_exits_2(tmp_path: Path) -> None:
    result = run_supervisor("run", "--config", str(DEMO), "--listen", "nope", env=daemon_env())
    assert result.returncode == 2
    assert "nope" in result.stderr
