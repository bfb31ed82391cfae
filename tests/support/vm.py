"""Run a test body inside the test guest (tests/guest/: QEMU, a real multi-NUMA kernel).

`run_in_vm(["--nodes", "2"], [PYTHON, "-m", "pytest", ...])` boots the guest
with the repository as its working directory and returns the completed
process. The guest sees the host's root filesystem read-only with a tmpfs
overlay, so the repo's .venv works there unchanged.

Both sides of the guest check scripts (tests/vm_checks/*.py): inside the
guest a `Checklist` prints one "PASS name: detail" / "FAIL name: detail" (or
"SKIP name: why") line per check; on the host `run_checks_in_vm` boots the
guest, runs one script and asserts that every expected check passed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# PS_GUEST_RUN: another harness with the same options, exit codes and PS_GUEST=1.
RUN_IN_VM = Path(os.environ.get("PS_GUEST_RUN", REPO / "tests/guest/run-in-vm"))
PYTHON = str(REPO / ".venv/bin/python")


def vm_available() -> str | None:
    """None when the guest can boot here, else why not."""
    if not RUN_IN_VM.exists():
        return f"the guest harness is not at {RUN_IN_VM}"
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed (run .ci/setup)"
    if os.geteuid() != 0:
        return "the test guest needs root"
    return None


def require_vm() -> None:
    """Skip when the guest cannot boot; in CI that is a failure, not a skip."""
    why = vm_available()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"test guest unavailable in CI: {why}")
    pytest.skip(why)


# run-in-vm's own codes: 124 the guest ran past --timeout, 125 the VM or harness failed.
GUEST_HUNG = (124, 125)


def run_in_vm(
    vm_args: list[str], command: list[str], timeout_s: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """Boot the guest, run `command` in the repo, return the completed process.

    A guest that hangs or fails to boot gets one fresh boot more. Under TCG on
    two host cores the guest kernel once locked up for minutes ("soft lockup"
    on three vCPUs, seen once in about 40 boots; the same check then passed 6
    times in a row): an emulator hang, not a verdict on the code under test.
    A command that fails on its own is never retried.
    """
    require_vm()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    argv = [str(RUN_IN_VM), "--timeout", str(int(timeout_s)), *vm_args, "--", *command]
    first: subprocess.CompletedProcess[str] | None = None
    for _ in range(2):
        done = subprocess.run(
            argv,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s + 60,
            check=False,
        )
        if done.returncode not in GUEST_HUNG:
            break
        first = first or done
    if first is not None and done is not first:
        done.stderr = (
            f"[first boot ended with {first.returncode}; booted again]\n"
            f"{first.stdout[-2000:]}\n{first.stderr[-2000:]}\n[second boot]\n{done.stderr}"
        )
    return done


# -- guest check scripts ----------------------------------------------------------------------

VERDICTS = ("PASS", "FAIL", "SKIP")


class Checklist:
    """Inside the guest: one verdict line per check on stdout, and the failures."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, name: str, ok: bool, detail: str) -> bool:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)
        return ok

    def skip(self, name: str, why: str) -> None:
        print(f"SKIP {name}: {why}", flush=True)

    def guarded(self, name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
        """A check function whose exception is a FAIL of `name`, not the script's end."""

        def wrap(fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    fn()
                except Exception:
                    self.check(name, False, traceback.format_exc().replace("\n", " | "))

            return run

        return wrap

    def exit_code(self) -> int:
        return 1 if self.failed else 0


def parse_verdicts(stdout: str) -> dict[str, str]:
    """{check name: "PASS" | "FAIL" | "SKIP"} from a guest script's output (the last line wins)."""
    status: dict[str, str] = {}
    for line in stdout.splitlines():
        verdict, _, rest = line.partition(" ")
        if verdict in VERDICTS:
            status[rest.split(": ", 1)[0]] = verdict
    return status


def run_checks_in_vm(
    script: str,
    expected: Sequence[str],
    *,
    vm_args: Sequence[str] = ("--nodes", "2"),
    timeout_s: float = 300.0,
    args: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run the guest check `script` (a path from the repo root) with `args`; every
    name in `expected` must PASS, none may FAIL, and the script must exit 0."""
    done = run_in_vm(list(vm_args), [PYTHON, "-u", script, *args], timeout_s=timeout_s)
    status = parse_verdicts(done.stdout)
    for name in expected:
        assert status.get(name) == "PASS", (
            f"{name}: {status.get(name)}\n{done.stdout}\n{done.stderr}"
        )
    assert "FAIL" not in status.values(), done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    return done
