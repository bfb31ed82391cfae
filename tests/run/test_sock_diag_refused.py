"""A refused or failing sock_diag falls back to /proc/<pid>/net/tcp, once, in one line.

Each case runs the probe's own code (`check_listener_owner`) in a child process
under a real seccomp filter (prctl(PR_SET_SECCOMP) with a BPF program, through
ctypes) that refuses what a unit's `SystemCallErrorNumber=EPERM`, an LSM deny
(EACCES) or a kernel without netlink (EAFNOSUPPORT) refuses: socket(AF_NETLINK,
...); or that fails every recvfrom(2), a dump that errors after it was asked for.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon_support import (
    REPO,
    DaemonProcess,
    daemon_env,
    free_port,
    to_toml,
)
from tests.support.poll import poll

# (socket, recvfrom) syscall numbers (asm/unistd_64.h; asm-generic/unistd.h).
SYSCALLS = {"x86_64": (41, 45), "aarch64": (198, 207)}

CHILD = r"""
import ctypes, json, logging, os, socket, struct, sys
nr, errno_value, only_netlink = map(int, sys.argv[1:4])
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen()
port = srv.getsockname()[1]

# seccomp_data: nr at 0, arch at 4, args[0] at 16 (its low word on little-endian).
LD, JEQ, RET = 0x20, 0x15, 0x06
ALLOW, ERRNO = 0x7FFF0000, 0x00050000
prog = [(LD, 0, 0, 0), (JEQ, 0, 3, nr)]
prog += [(LD, 0, 0, 16), (JEQ, 0, 1, socket.AF_NETLINK)] if only_netlink else [(JEQ, 0, 0, 0)] * 2
prog += [(RET, 0, 0, ERRNO | errno_value), (RET, 0, 0, ALLOW)]
raw = b"".join(struct.pack("HBBI", *insn) for insn in prog)
buf = ctypes.create_string_buffer(raw)
fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
fbuf = ctypes.create_string_buffer(fprog)
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
# PR_SET_SECCOMP, SECCOMP_MODE_FILTER
assert libc.prctl(22, 2, ctypes.addressof(fbuf), 0, 0) == 0, ctypes.get_errno()

if only_netlink:  # the filter is really there
    try:
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4)
        raise SystemExit("the seccomp filter let the netlink socket through")
    except OSError as err:
        assert err.errno == errno_value, err

from supervisor.hostfs import HostFS
from supervisor.run import listeners
from supervisor.run.listeners import check_listener_owner

fs = HostFS("/")
# The probe's own call: today's first refusal must not be an error of the probe.
first = check_listener_owner(fs, os.getpid(), "127.0.0.1", port)
second = check_listener_owner(fs, os.getpid(), "127.0.0.1", port)
other = check_listener_owner(fs, os.getpid(), "127.0.0.1", 1)
refused = listeners.LISTENERS.refused
print(json.dumps({"first": first, "second": second, "other": other, "refused": refused}))
"""


@pytest.mark.parametrize(
    ("call", "code"),
    [
        ("socket", errno.EPERM),
        ("socket", errno.EACCES),
        ("socket", errno.EAFNOSUPPORT),
        ("socket", errno.EPROTONOSUPPORT),
        ("recvfrom", errno.EIO),
    ],
)
def test_a_refused_sock_diag_falls_back_once(call: str, code: int) -> None:
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None:
        pytest.skip(f"no syscall numbers for {platform.machine()}")
    nr = numbers[0] if call == "socket" else numbers[1]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(nr), str(code), "1" if call == "socket" else "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["first"] is None, found  # ready: our own listener, from /proc/<pid>/net/tcp
    assert found["second"] is None, found
    assert found["other"] == "nothing listens on port 1", found
    name = errno.errorcode[code]
    assert name in found["refused"], found
    lines = [line for line in done.stderr.splitlines() if "listener source" in line]
    assert len(lines) == 1, done.stderr[-3000:]  # once, not at every probe
    assert "path=/proc/<pid>/net/tcp{,6}" in lines[0] and name in lines[0], lines


def test_an_allowed_sock_diag_says_so_once() -> None:
    code = (
        "import logging, os, socket, sys, json;"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO, format='%(message)s');"
        "from supervisor.hostfs import HostFS;"
        "from supervisor.run.listeners import LISTENERS, check_listener_owner;"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen();"
        "p = s.getsockname()[1];"
        "r = [check_listener_owner(HostFS('/'), os.getpid(), '127.0.0.1', p) for _ in range(2)];"
        "print(json.dumps([r, LISTENERS.refused]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [[None, None], None]
    lines = [line for line in done.stderr.splitlines() if "listener source" in line]
    assert len(lines) == 1 and "path=sock_diag" in lines[0], done.stderr[-3000:]


ENGINE = r"""
import socket, sys, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen()
time.sleep(3600)
"""


@pytest.mark.parametrize("code", [errno.EPERM, errno.EACCES])
def test_a_daemon_whose_sock_diag_is_refused_gets_its_engine_ready(
    tmp_path: Path, code: int
) -> None:
    if platform.machine() not in SYSCALLS:
        pytest.skip(f"no syscall numbers for {platform.machine()}")
    engine = tmp_path / "engine.py"
    engine.write_text(ENGINE)
    port = free_port()
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 2,
        "engine": {"command": ["python", str(engine), str(port)]},
        "ready": {"tcp": f"127.0.0.1:{port}", "timeout_s": 20},
        "workers": {"command": ["python", "-c", "import time; time.sleep(3600)", "{rank}"]},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
    }
    config = tmp_path / "diag.toml"
    config.write_text(to_toml(doc))
    prefix = [sys.executable, str(REPO / "tests/support/seccomp_exec.py"), str(code), "--"]
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env(), prefix=prefix) as d:
        poll(d.running, timeout_s=30, what="the engine ready through the /proc tables")
        code_ = d.stop(timeout_s=30)
    log = d.log.read_text(errors="replace")
    assert code_ == 0, log[-4000:]
    lines = [line for line in log.splitlines() if "listener source" in line]
    assert len(lines) == 1 and errno.errorcode[code] in lines[0], log[-4000:]
    assert "ready probe error" not in log, log[-4000:]
