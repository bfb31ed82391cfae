"""Fixtures of the node agent's tests."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture
def runc_on_two_cpus() -> None:
    """Skips without runc (.ci/setup installs it) or without CPUs 0 and 1."""
    if subprocess.run(["which", "runc"], capture_output=True, check=False).returncode:
        pytest.skip("runc is not installed (.ci/setup installs it)")
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
