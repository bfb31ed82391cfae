"""Shared pytest fixtures: where the repo is, and the numavm guest runner."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture
def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (cgroups, /proc/irq, other processes' affinity)")
