"""A reload is checked like a start (issue 30 item 5): what `run` refuses at start
a SIGHUP refuses with result "invalid" before any process is touched, and a key
the running daemon would not apply is refused, never reloaded `ok`. Real daemon,
real SIGHUPs, the children's pids read from the API and /proc.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

from tests.support.children import write_child
from tests.support.daemon_support import (
    DaemonProcess,
    child_config,
    daemon_env,
    entries,
    to_toml,
)
from tests.support.poll import poll


def _pids(doc: dict[str, Any]) -> dict[str, int]:
    return {str(e.get("rank", "engine")): e["pid"] for e in entries(doc)}


def _reloads(d: DaemonProcess) -> dict[str, int]:
    counted: dict[str, int] = (d.placement() or {}).get("supervisor", {}).get("config_reloads", {})
    return counted


def _hup(d: DaemonProcess, config: Path, doc: dict[str, Any], result: str, count: int) -> str:
    """Write `doc`, SIGHUP, wait for the `count`th reload of `result`; its log line."""
    config.write_text(to_toml(doc))
    os.kill(d.pid, signal.SIGHUP)
    poll(lambda: _reloads(d).get(result, 0) >= count, timeout_s=60, what=f"reload {result}")
    word = "reload failed" if result == "invalid" else "reload refused"
    lines = [line for line in d.tail(200_000).splitlines() if word in line]
    assert len(lines) >= count, d.tail()
    return lines[-1]


def test_a_reload_refuses_what_run_refuses_and_touches_no_process(tmp_path: Path) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    doc = child_config(script, out, engine=True)
    config.write_text(to_toml(doc))
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as d:
        before = _pids(poll(d.running, timeout_s=60, what="engine and ranks running"))
        assert len(before) == 3

        missing = copy.deepcopy(doc)
        missing["workers"]["command"] = ["/nonexistent/bin/worker", "{rank}"]
        line = _hup(d, config, missing, "invalid", 1)
        assert f"{config}: workers.command" in line and "/nonexistent/bin/worker" in line, line

        big = copy.deepcopy(doc)
        big["workers"]["env"] = {"HUGE_VALUE": "x" * 200_000}
        line = _hup(d, config, big, "invalid", 2)
        assert "'HUGE_VALUE'" in line and "MAX_ARG_STRLEN" in line, line

        module = copy.deepcopy(doc)
        module["workers"]["command"] = ["python", "-m", "no_such_module_for_reload", "{rank}"]
        line = _hup(d, config, module, "invalid", 3)
        assert "has no module 'no_such_module_for_reload'" in line, line

        # An account that may not execute the command: asked from the daemon, which
        # has threads by now (test(1) exec'd as the account, not a bare fork).
        if os.geteuid() == 0:
            shared = Path(tempfile.mkdtemp(prefix="ps-reload-", dir="/tmp"))
            try:
                shared.chmod(0o755)
                private = shared / "worker"
                shutil.copy("/bin/true", private)
                private.chmod(0o700)  # root's own: nobody gets EACCES
                account = copy.deepcopy(doc)
                account["workers"].update(command=[str(private), "{rank}"], user="nobody")
                line = _hup(d, config, account, "invalid", 4)
                assert f"{private} is not executable by user 'nobody'" in line, line
                private.chmod(0o755)  # the same command nobody may run: not refused for it
                account["workers"]["command"] = [str(private), "{rank}"]
                account["workers"]["env"] = {"HUGE_VALUE": "x" * 200_000}
                line = _hup(d, config, account, "invalid", 5)
                assert "is not executable" not in line and "'HUGE_VALUE'" in line, line
            finally:
                shutil.rmtree(shared, ignore_errors=True)

        # The engine kind is the adopter's, fixed at start: refused, not `ok` and ignored.
        kind = copy.deepcopy(doc)
        kind["engine"]["kind"] = "torchrun"
        line = _hup(d, config, kind, "refused", 1)
        assert "engine.kind (custom -> torchrun)" in line, line

        now = poll(d.running, timeout_s=10, what="all still running")
        assert _pids(now) == before, (before, now)
        assert _reloads(d).get("ok", 0) == 0
        assert now["supervisor"]["ready"], now["supervisor"]
        restarts = [e for e in entries(now) if e.get("restarts")]
        assert restarts == [], restarts
        assert d.stop(timeout_s=30) == 0, d.tail()
