""".ci/setup on a shared host: apt-get waits for the apt/dpkg lock another install holds.

The lock is held for real (fcntl, as apt and dpkg hold theirs) on a private
lists dir (`Dir::State::Lists`), so neither the host's lock nor its package
lists are touched, and apt-get runs for real through `.ci/apt-lock.sh`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o640)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


@pytest.fixture
def private_apt(tmp_path: Path) -> list[str]:
    """apt-get options for an update that reads no source and writes only under tmp_path."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("needs root and apt-get")
    lists = tmp_path / "lists"
    (lists / "partial").mkdir(parents=True)
    (tmp_path / "sources.list").write_text("")
    (tmp_path / "sources.list.d").mkdir()
    return [
        "-o",
        f"Dir::State::Lists={lists}",
        "-o",
        f"Dir::Etc::sourcelist={tmp_path / 'sources.list'}",
        "-o",
        f"Dir::Etc::sourceparts={tmp_path / 'sources.list.d'}",
    ]


@pytest.fixture
def held_lock(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lists lock, as a concurrent `apt-get update` does."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "lists" / "lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()


def _apt_get(args: list[str], wait_s: int) -> subprocess.Popen[str]:
    script = '. .ci/apt-lock.sh && apt_get "$@"'
    return subprocess.Popen(
        ["bash", "-c", script, "apt_get", *args],
        cwd=REPO,
        env=dict(os.environ, APT_LOCK_WAIT_S=str(wait_s)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_apt_get_waits_for_the_lock_and_runs_once_it_is_free(
    private_apt: list[str], held_lock: subprocess.Popen[str]
) -> None:
    # Plain apt-get fails at once (exit 100) while the lock is held: what .ci/setup did.
    plain = subprocess.run(
        ["apt-get", *private_apt, "update", "-qq"], capture_output=True, text=True, check=False
    )
    assert plain.returncode == 100 and "Could not get lock" in plain.stderr, plain.stderr
    waiting = _apt_get([*private_apt, "update", "-qq"], wait_s=120)
    assert waiting.stderr is not None
    line = waiting.stderr.readline()  # its first "waiting" line: it did not give up
    assert "Could not get lock" in line and "waiting" in line, line
    assert waiting.poll() is None
    assert held_lock.stdin is not None
    held_lock.stdin.close()  # the other install ends
    held_lock.wait()
    _, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err


def test_apt_get_gives_up_at_the_deadline_with_apt_gets_own_error(
    private_apt: list[str], held_lock: subprocess.Popen[str]
) -> None:
    start = time.monotonic()
    proc = _apt_get([*private_apt, "update", "-qq"], wait_s=1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 100, err
    assert "E: Could not get lock" in err and time.monotonic() - start >= 1


def test_other_failures_are_not_retried(private_apt: list[str]) -> None:
    proc = _apt_get([*private_apt, "no-such-command"], wait_s=600)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 100 and "waiting" not in err, err


def test_setup_runs_every_apt_get_through_the_lock_wait() -> None:
    text = (REPO / ".ci" / "setup").read_text()
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert ". .ci/apt-lock.sh" in code
    bare = [line for line in code if re.search(r"(^|[;&|(\s])apt-get\s", line)]
    assert bare == [], bare
    assert sum("apt_get " in line for line in code) == 2  # update, install
