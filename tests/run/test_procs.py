"""Child processes: real spawns, process groups, pidfd identity, TERM/KILL, reaping."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import uvloop

from supervisor.hostfs import HostFS
from supervisor.procfs.stat import read_proc_stat
from supervisor.run.procs import ChildProcess, read_until_eof, spawn
from tests.support.poll import wait_until

T = TypeVar("T")
FS = HostFS("/")
ENV = dict(os.environ)


def run(main: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(30):
            return await main()

    return uvloop.run(bounded())


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def state_of(pid: int) -> str | None:
    stat = read_proc_stat(FS, pid)
    return None if stat is None else stat.state


def gone_or_zombie(pid: int) -> bool:
    return state_of(pid) in (None, "Z", "X")


def test_child_leads_its_own_session_and_group_and_is_reaped() -> None:
    async def main() -> tuple[int, int, int, int]:
        child = spawn(py("import time; time.sleep(0.3); raise SystemExit(3)"), ENV)
        pgid, sid = os.getpgid(child.pid), os.getsid(child.pid)
        code = await child.wait()
        return child.pid, pgid, sid, code

    pid, pgid, sid, code = run(main)
    assert pgid == pid and sid == pid
    assert code == 3
    after = read_proc_stat(FS, pid)
    assert after is None or after.ppid != os.getpid()  # reaped: no zombie of ours


def test_stop_terms_the_group() -> None:
    async def main() -> int:
        child = spawn(py("import time; time.sleep(60)"), ENV)
        return await child.stop(5.0)

    assert run(main) == -signal.SIGTERM


def test_stop_kills_a_child_that_ignores_term() -> None:
    # The child says "ok" on a pipe once SIG_IGN is in place, then sleeps.
    code = (
        "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " fd = int(sys.argv[1]); os.write(fd, b'ok'); os.close(fd); time.sleep(60)"
    )

    async def main() -> tuple[bytes, int, float]:
        read_fd, write_fd = os.pipe()
        child = spawn([*py(code), str(write_fd)], ENV, pass_fds=(write_fd,))
        os.close(write_fd)
        said = await read_until_eof(read_fd, 10.0)
        started = time.monotonic()
        result = await child.stop(0.5)
        return said, result, time.monotonic() - started

    said, result, took_s = run(main)
    assert said == b"ok"
    assert result == -signal.SIGKILL
    assert took_s >= 0.5


def test_a_crashed_childs_leftover_group_members_are_killed() -> None:
    # The child starts a grandchild in its group, reports its pid, then exits.
    code = (
        "import subprocess, sys, os;"
        " p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        " os.write(int(sys.argv[1]), str(p.pid).encode()); os._exit(1)"
    )

    async def main() -> tuple[int, int]:
        read_fd, write_fd = os.pipe()
        child = spawn([*py(code), str(write_fd)], ENV, pass_fds=(write_fd,))
        os.close(write_fd)
        grandchild = int((await read_until_eof(read_fd, 10.0)).decode())
        return await child.wait(), grandchild

    exit_code, grandchild = run(main)
    assert exit_code == 1
    assert wait_until(lambda: gone_or_zombie(grandchild), 10.0, 0.02)


def test_a_reaped_child_is_never_signalled_again() -> None:
    async def main() -> ChildProcess:
        child = spawn(py("pass"), ENV)
        await child.wait()
        return child

    child = run(main)
    assert child.returncode == 0
    assert child.send_signal(signal.SIGTERM) is False
    assert child.signal_group(signal.SIGTERM) is False


def test_read_until_eof_ends_at_exec() -> None:
    # The write end is inherited, then closed by exec (set_inheritable False +
    # exec), like the shim's report fd: EOF arrives while the process lives on.
    code = (
        "import os, sys; fd = int(sys.argv[1]); os.write(fd, b'report\\n');"
        " os.set_inheritable(fd, False);"
        " os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)'])"
    )

    async def main() -> tuple[bytes, bool]:
        read_fd, write_fd = os.pipe()
        child = spawn([*py(code), str(write_fd)], ENV, pass_fds=(write_fd,))
        os.close(write_fd)
        data = await read_until_eof(read_fd, 10.0)
        alive = child.returncode is None and not gone_or_zombie(child.pid)
        await child.stop(5.0)
        return data, alive

    data, alive = run(main)
    assert data == b"report\n"
    assert alive


def test_read_until_eof_times_out_with_what_it_has() -> None:
    async def main() -> bytes:
        read_fd, write_fd = os.pipe()
        os.write(write_fd, b"partial")
        try:
            return await read_until_eof(read_fd, 0.2)
        finally:
            os.close(write_fd)

    assert run(main) == b"partial"


def test_spawn_of_a_missing_executable_raises() -> None:
    with pytest.raises(FileNotFoundError):
        spawn(["/nonexistent/placement-supervisor-test"], ENV)
