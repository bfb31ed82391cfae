"""The guardian's last line names the supervisor that died (its parent while it
lived), not the process it was reparented to afterwards (init: pid=1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.daemon_support import (
    REPO,
)
from tests.support.poll import poll

PARENT = r"""
import os, sys
from supervisor.trees.guardian import Guardian
guardian = Guardian.start()
assert guardian is not None
print(os.getpid(), guardian.pid, flush=True)
os._exit(0)  # as a SIGKILLed daemon: no "bye"; the guardian reads EOF
"""


def test_the_guardian_names_the_supervisor_that_died(tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    with err.open("w") as f:
        done = subprocess.run(
            [sys.executable, "-c", PARENT],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
            timeout=60,
            check=True,
        )
    parent, guardian = (int(w) for w in done.stdout.split())
    line = poll(
        lambda: next((ln for ln in err.read_text().splitlines() if "guardian:" in ln), None),
        timeout_s=30,
        what="the guardian's line",
    )
    assert f"supervisor gone pid={parent} " in line, line
    assert guardian != parent
