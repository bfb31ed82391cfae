"""`placement-supervisor run --demo` after a non-editable install: the wheel carries the demo
config, and the daemon runs it from any directory (a real pip build, a real daemon, SIGTERM)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.daemon_support import (
    REPO,
    daemon_env,
    free_port,
    get_json,
    stop_process,
)
from tests.support.poll import poll

DEMO_ENGINE_PORT = 9478  # supervisor/demo/demo.toml's [ready] tcp


def _answers(port: int) -> bool:
    try:
        return get_json(f"http://127.0.0.1:{port}/readyz").get("ready") is True
    except OSError:
        return False


def test_run_demo_after_a_plain_pip_install(tmp_path: Path) -> None:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", DEMO_ENGINE_PORT)) == 0:
            pytest.skip(f"port {DEMO_ENGINE_PORT} (the demo engine's) is in use on this host")
    # A copy of the source: the build writes build/ and *.egg-info next to pyproject.toml.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(
        REPO / "supervisor", src / "supervisor", ignore=shutil.ignore_patterns("__pycache__")
    )
    site = tmp_path / "site"
    offline = ["--no-deps", "--no-build-isolation", "--no-index"]  # built from what is here
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", *offline, "--target", str(site), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert (site / "supervisor" / "demo" / "demo.toml").is_file()
    port = free_port()
    env = daemon_env(PYTHONPATH=str(site))  # the installed copy, not this checkout
    run = tmp_path / "run"
    run.mkdir()  # neither the checkout nor the install: configs/ is not there
    with open(tmp_path / "daemon.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", "--demo", "--listen", f"127.0.0.1:{port}"],
            cwd=run,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            poll(lambda: proc.poll() is None and _answers(port), timeout_s=90, what="demo ready")
            doc = get_json(f"http://127.0.0.1:{port}/placement")
            config = Path(doc["supervisor"]["config"])
            assert config.is_relative_to(site), config
            assert len(doc["ranks"]) >= 2 and doc["engine"]["state"] == "running"
        finally:
            # One SIGTERM (stop_process sends it): a second during the stop is the
            # operator's "exit now" (143, docs/contracts.md §1).
            code = stop_process(proc, 30)
    text = (tmp_path / "daemon.log").read_text(errors="replace")
    assert code == 0, text[-4000:]
