"""sd_notify client against real AF_UNIX datagram sockets (path and abstract)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.daemon.sdnotify import Notifier, parse_notify_address, watchdog_interval_s


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()


def test_ready_status_watchdog_stopping_arrive_as_datagrams(
    path_socket: tuple[socket.socket, str],
) -> None:
    sock, path = path_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("3/3 running")
    assert sock.recv(4096) == b"READY=1\nSTATUS=3/3 running"
    assert notifier.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert notifier.status("degraded")
    assert sock.recv(4096) == b"STATUS=degraded"
    assert notifier.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    notifier.close()


def test_reloading_carries_monotonic_usec(path_socket: tuple[socket.socket, str]) -> None:
    sock, path = path_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notifier.reloading("reloading c.toml")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = sock.recv(4096).decode().splitlines()
    assert lines[0] == "RELOADING=1" and lines[2] == "STATUS=reloading c.toml"
    name, _, usec = lines[1].partition("=")
    assert name == "MONOTONIC_USEC" and before <= int(usec) <= after
    assert notifier.reloading("x", monotonic_usec=42)
    assert sock.recv(4096) == b"RELOADING=1\nMONOTONIC_USEC=42\nSTATUS=x"
    notifier.close()


def test_abstract_socket_name() -> None:
    name = f"placement-supervisor-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready()
        assert sock.recv(4096) == b"READY=1"
        notifier.close()
    finally:
        sock.close()


def test_without_notify_socket_every_call_is_a_noop() -> None:
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()


def test_a_missing_socket_is_reported_not_raised(tmp_path: Path) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "absent.sock")})
    assert notifier.ready() is False
    assert notifier.stopping() is False


def test_parse_notify_address() -> None:
    assert parse_notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert parse_notify_address("@abc") == b"\0abc"
    assert parse_notify_address("relative/path") is None
    assert parse_notify_address("@") is None


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}, pid=1) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, pid=7) == 15.0


def test_watchdog_for_another_pid_or_garbled_is_off() -> None:
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, pid=7) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}, pid=7) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}, pid=7) is None
    assert watchdog_interval_s({}, pid=7) is None
