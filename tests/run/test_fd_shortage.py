"""A respawn that finds no file descriptor: backed off and retried, never held failed.

The daemon runs in this process (tests.daemon.test_root's harness) with real
children; the test lowers its own soft RLIMIT_NOFILE, fills every free
descriptor, SIGKILLs a worker, and gives the descriptors back later.
"""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.config import parse_config
from supervisor.daemon.root import Daemon
from tests.daemon.test_root import all_running, events, run_daemon, status
from tests.support.children import write_child
from tests.support.daemon_support import (
    child_config,
)
from tests.support.poll import until


@pytest.fixture
def fd_limit() -> Iterator[None]:
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def fill_fds() -> list[int]:
    """Lower the soft limit to just above the highest fd open now, and take the rest."""
    highest = max(int(n) for n in os.listdir(f"/proc/{os.getpid()}/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, hard))
    taken = []
    try:
        while True:
            taken.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        pass
    return taken


def test_a_respawn_out_of_fds_backs_off_and_comes_back(tmp_path: Path, fd_limit: None) -> None:
    script, out = write_child(tmp_path)
    config = parse_config(child_config(script, out), "test.toml")  # crash_loop_limit = 3
    limit = config.restart.crash_loop_limit

    async def scenario(daemon: Daemon) -> None:
        await until(lambda: all_running(daemon))
        old = status(daemon, 0).pid
        assert old is not None
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)
        taken = fill_fds()
        try:
            os.kill(old, signal.SIGKILL)
            # More failed starts than the crash loop allows, and still retrying.
            await until(lambda: len(events(daemon, "spawn_failed", 0)) > limit, timeout_s=30)
            assert status(daemon, 0).state in ("backoff", "starting")
        finally:
            for fd in taken:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, soft)
        await until(lambda: status(daemon, 0).pid not in (None, old) and all_running(daemon))

    daemon = run_daemon(config, scenario)
    failed = events(daemon, "spawn_failed", 0)
    assert "out of file descriptors" in failed[0].fields["error"]
    states = [e.fields["new"] for e in events(daemon, "state", 0)]
    assert "failed" not in states
    assert states.count("running") == 2  # before the kill, and after the fds came back
    reasons = [e.fields["reason"] for e in events(daemon, "restart", 0)]
    assert any("out of file descriptors" in r for r in reasons)
