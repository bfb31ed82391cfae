"""Run a test body inside the numavm QEMU guest (a real multi-NUMA kernel).

`run_in_vm(["--nodes", "2"], "python3 -m pytest ...")` boots the guest with
the repository as its working directory and returns (exit code, output).
The guest sees the host's root filesystem read-only with a tmpfs overlay, so
the repo's .venv works there unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN_IN_VM = Path(os.environ.get("NUMAVM_RUN", REPO.parent / "shared/tools/numavm/run-in-vm"))
PYTHON = str(REPO / ".venv/bin/python")


def vm_available() -> str | None:
    """None when the guest can boot here, else why not."""
    if not RUN_IN_VM.exists():
        return f"numavm not found at {RUN_IN_VM}"
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed (run .ci/setup)"
    if os.geteuid() != 0:
        return "the numavm guest needs root"
    return None


def require_vm() -> None:
    """Skip when the guest cannot boot; in CI that is a failure, not a skip."""
    why = vm_available()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"numavm guest unavailable in CI: {why}")
    pytest.skip(why)


def run_in_vm(
    vm_args: list[str], command: list[str], timeout_s: float = 600.0
) -> subprocess.CompletedProcess[str]:
    """Boot the guest, run `command` in the repo, return the completed process."""
    require_vm()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [str(RUN_IN_VM), "--timeout", str(int(timeout_s)), *vm_args, "--", *command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
        check=False,
    )
