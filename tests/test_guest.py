"""The test guest's harness (tests/guest/run-in-vm): what a job gets back, and
the exit codes tests/support/vm.py tells apart (124 timeout, 125 harness)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.vm import REPO, RUN_IN_VM, require_vm, run_in_vm

pytestmark = pytest.mark.vm


@pytest.mark.timeout(600)
def test_the_job_gets_the_repo_and_a_private_root_and_gives_back_output_and_code() -> None:
    marker = Path(f"/var/tmp/guest-write-{os.getpid()}")
    script = (
        "echo out; echo err >&2; "
        'echo "guest=$PS_GUEST cwd=$PWD nodes=$(cat /sys/devices/system/node/online)"; '
        f"touch {marker} && echo wrote; exit 7"
    )
    done = run_in_vm([], ["bash", "-c", script], timeout_s=240)
    assert done.returncode == 7, done.stdout + done.stderr
    assert done.stdout.splitlines()[-3:] == [
        "out",
        f"guest=1 cwd={REPO} nodes=0-1",
        "wrote",
    ], done.stdout
    assert "err" in done.stderr.splitlines()
    assert not marker.exists()  # the write went to the guest's tmpfs overlay


def _harness(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    require_vm()
    return subprocess.run(
        [str(RUN_IN_VM), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_a_guest_past_its_timeout_is_killed_with_124() -> None:
    done = _harness("--timeout", "2", "--", "sleep", "600")
    assert done.returncode == 124, done.stderr
    assert "timed out after 2s" in done.stderr


def test_a_bad_harness_option_is_125_and_named() -> None:
    done = _harness("--cgroup", "v3", "--", "true")
    assert done.returncode == 125
    assert "--cgroup must be v1, v2 or hybrid" in done.stderr
