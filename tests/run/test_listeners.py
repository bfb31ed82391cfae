"""Listener ownership where the TCP table is huge: sock_diag, and the streamed fallback.

Real sockets in private network namespaces (`unshare -n`, root), a real child
in another namespace, and a fixture tree whose table is past the 1 MiB read cap
that made the old check raise at ~7,000 sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.bind.sock_diag import dump_tcp_listeners, dump_tcp_listeners_in
from supervisor.hostfs import HostFS, SpecialFileError
from supervisor.run.listeners import (
    Listener,
    check_listener_owner,
    read_listeners,
    same_netns,
    stream_listeners,
)
from tests.support.daemon_support import free_port

FS = HostFS("/")
needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="needs root, unshare(1) and ip(8) for a private network namespace",
)

LISTENER = r"""
import socket, sys
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
sys.stdin.read()
"""


@needs_unshare
def test_the_owner_is_found_among_100000_sockets() -> None:
    done = subprocess.run(
        [
            "unshare",
            "-n",
            sys.executable,
            "-m",
            "tests.support.socket_flood",
            "--sockets",
            "100000",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["tcp_rows"] >= 100_000
    # What the old check did: one capped read of the whole table. It raises here.
    assert "larger than 1048576 bytes" in found["capped_read"]
    assert found["same_netns"] is True  # the sock_diag path, not the fallback
    assert found["owner"] is None
    assert "outside the engine's tree" in found["stranger"]
    assert found["port"] in found["streamed_ports"]  # the fallback finds it too


def _stat_line(pid: int, ppid: int) -> str:
    return f"{pid} (engine) S {ppid} {pid} {pid} 0 -1 0 0 0 0 0 1 1 0 0 20 0 1 0 {100 + pid} 0 0\n"


def _tcp_row(slot: int, local: str, remote: str, state: str, inode: int) -> str:
    return (
        f"{slot:4d}: {local} {remote} {state} 00000000:00000000 00:00000000 00000000"
        f"     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
    )


@pytest.mark.skipif(sys.byteorder != "little", reason="the rows are written as x86 prints them")
def test_a_fixture_table_past_the_read_cap_is_streamed(tmp_path: Path) -> None:
    # Engine pid 100, its child 101 holds the listener 127.0.0.1:8000 (inode
    # 4242) among 12,000 TIME_WAIT rows: ~1.8 MB, past the 1 MiB cap.
    proc = tmp_path / "proc"
    for pid, ppid in ((100, 1), (101, 100), (300, 1)):
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(_stat_line(pid, ppid))
    os.symlink("socket:[4242]", proc / "101" / "fd" / "3")
    os.symlink("/dev/null", proc / "100" / "fd" / "0")
    os.symlink("/dev/null", proc / "300" / "fd" / "0")
    rows = ["  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt\n"]
    rows.append(_tcp_row(0, "0100007F:1F40", "00000000:0000", "0A", 4242))
    rows += [_tcp_row(i, "0100007F:1F40", f"0100007F:{i:04X}", "06", 0) for i in range(1, 12_001)]
    net = proc / "100" / "net"
    net.mkdir()
    (net / "tcp").write_text("".join(rows))
    fs = HostFS(str(tmp_path))
    assert (net / "tcp").stat().st_size > 1 << 20
    with pytest.raises(SpecialFileError):
        fs.read_text("proc/100/net/tcp")  # the old whole-file read
    assert not same_netns(fs, 100)  # a fixture tree: never the live kernel's answer
    assert read_listeners(fs, 100) == [Listener("127.0.0.1", 8000, 4242)]  # no tcp6: no rows
    assert check_listener_owner(fs, 100, "127.0.0.1", 8000) is None
    assert check_listener_owner(fs, 100, "127.0.0.1", 8001) == "nothing listens on port 8001"
    (proc / "300" / "net").symlink_to(net)  # a stranger in the same namespace
    refused = check_listener_owner(fs, 300, "127.0.0.1", 8000)
    assert refused is not None and "outside the engine's tree" in refused
    assert stream_listeners(fs, 999) == []  # gone


@needs_unshare
def test_an_engine_in_another_network_namespace_is_checked_in_its_namespace() -> None:
    port = free_port()
    # unshare(1) execs python in place: the pid is the listener's, its namespace new.
    engine = subprocess.Popen(
        ["unshare", "-n", sys.executable, "-c", LISTENER, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    check = (
        "import sys; from supervisor.hostfs import HostFS;"
        "from supervisor.bind.sock_diag import dump_tcp_listeners_in;"
        "from supervisor.run.listeners import check_listener_owner;"
        "pid, port = int(sys.argv[1]), int(sys.argv[2])\n"
        "try: dump_tcp_listeners_in(f'/proc/{pid}/ns/net')\n"
        "except OSError as err: print(type(err).__name__)\n"
        "print(check_listener_owner(HostFS('/'), pid, '127.0.0.1', port))"
    )
    try:
        assert engine.stdout is not None
        assert engine.stdout.readline().strip() == "listening"
        assert not same_netns(FS, engine.pid)
        listener = Listener("127.0.0.1", port, _inode_of_listener(engine.pid))
        # Not in our namespace's dump; in the dump of a thread that joined its
        # namespace, and in its own table (the fallback) alike.
        assert all(s.inode != listener.inode for s in dump_tcp_listeners())
        joined = dump_tcp_listeners_in(FS.path(f"proc/{engine.pid}/ns/net"))
        assert [(s.address, s.port, s.inode) for s in joined] == [
            (listener.address, listener.port, listener.inode)
        ]
        assert read_listeners(FS, engine.pid) == [listener] == stream_listeners(FS, engine.pid)
        assert check_listener_owner(FS, engine.pid, "127.0.0.1", port) is None
        # Without CAP_SYS_ADMIN setns(2) is refused (EPERM): the table is streamed.
        denied = subprocess.run(
            [
                *("setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin"),
                *(sys.executable, "-c", check, str(engine.pid), str(port)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert denied.stdout.split() == ["PermissionError", "None"], denied.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            engine.kill()
        engine.wait()


def test_joining_a_namespace_that_is_gone_raises_and_leaves_this_thread_where_it_was(
    tmp_path: Path,
) -> None:
    before = FS.readlink("proc/thread-self/ns/net")
    with pytest.raises(FileNotFoundError):
        dump_tcp_listeners_in(str(tmp_path / "no-such-ns"))
    with pytest.raises(OSError, match="Invalid argument"):  # a directory is no namespace
        dump_tcp_listeners_in(str(tmp_path))
    assert FS.readlink("proc/thread-self/ns/net") == before


def _inode_of_listener(pid: int) -> int:
    for fd in FS.listdir(f"proc/{pid}/fd"):
        target = FS.readlink(f"proc/{pid}/fd/{fd}") or ""
        if target.startswith("socket:["):
            return int(target[8:-1])
    raise AssertionError(f"pid {pid} holds no socket")
