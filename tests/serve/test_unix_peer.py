"""Changing calls over the API's unix socket are checked against the peer's
credentials (SO_PEERCRED, SO_PEERGROUPS), not only the socket file's mode: after
a `chmod 0666`, `nobody` still cannot restart ranks, unless `[api]
unix_socket_group` names a group it is in. Real sockets, a real `nobody` client.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.config import ApiConfig
from supervisor.errors import ConfigError
from supervisor.listen import parse_listen
from supervisor.serve.peer import UnixPolicy
from tests.support.api_fixture import ServerThread, realistic_snapshot

CLIENT = r"""
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
sock.sendall(b"POST /ranks/0/restart HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
             b"Connection: close\r\n\r\n")
data = b""
while chunk := sock.recv(65536):
    data += chunk
print(data.split(b"\r\n", 1)[0].decode(), data.rsplit(b"\r\n\r\n", 1)[-1].decode())
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs a client as nobody")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="ps-peer-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


# nobody may not enter the test's virtual environment: the system's Python (stdlib only).
SYSTEM_PYTHON = next(
    (p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None
)


def as_nobody(sock: Path) -> str:
    if SYSTEM_PYTHON is None:
        pytest.skip("no system python3 for the nobody client")
    nobody = pwd.getpwnam("nobody")
    done = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-S", "-c", CLIENT, str(sock)],
        user=nobody.pw_uid,
        group=nobody.pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def serve(sock: Path, group: str | None = None) -> ServerThread:
    config = ApiConfig(
        listen=parse_listen("127.0.0.1:0"), unix_socket=str(sock), unix_socket_group=group
    )
    return ServerThread(realistic_snapshot(), config)


def test_nobody_is_refused_over_a_socket_made_world_writable(open_dir: Path) -> None:
    sock = open_dir / "api.sock"
    with serve(sock) as srv:
        sock.chmod(0o666)  # what someone's chmod does: the mode no longer keeps anyone out
        out = as_nobody(sock)
        assert out.startswith("HTTP/1.1 403"), out
        assert "uid 65534" in out and "root or the supervisor's user" in out, out
        assert srv.actions.calls == []
        # Root still may (the peer's uid, whatever the mode).
        assert as_root(sock).startswith("HTTP/1.1 200")
        assert srv.actions.calls == [("restart", 0)]


def as_root(sock: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", CLIENT, str(sock)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout


def test_a_member_of_the_configured_group_may(open_dir: Path) -> None:
    sock = open_dir / "api.sock"
    group = pwd.getpwnam("nobody").pw_gid  # nobody's own group: a member
    with serve(sock, str(group)) as srv:
        sock.chmod(0o666)
        out = as_nobody(sock)
        assert out.startswith("HTTP/1.1 200"), out
        assert srv.actions.calls == [("restart", 0)]


def test_an_unknown_group_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"api\.unix_socket_group: no group .no-such-group-x."):
        UnixPolicy.of("no-such-group-x")
