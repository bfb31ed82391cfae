"""SIGHUP from the first instruction to the last: a real daemon under a storm of
real HUPs from the moment its entry point runs to 3 s after spawn, and again all
through a SIGTERM stop, survives, stops cleanly (exit 0) and removes its lock.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from supervisor.daemon.instance_lock import lock_name
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

HUP_BIT = 1 << (signal.SIGHUP - 1)


def _disposition(pid: int) -> str | None:
    """ "ignored", "caught" or None (default) for SIGHUP in /proc/<pid>/status."""
    fields = dict(
        line.split(":\t", 1)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":\t" in line
    )
    if int(fields["SigIgn"], 16) & HUP_BIT:
        return "ignored"
    if int(fields["SigCgt"], 16) & HUP_BIT:
        return "caught"
    return None


class Storm:
    """A thread that sends SIGHUP to `pid` every `every_s` until stopped or it is gone."""

    def __init__(self, pid: int, every_s: float) -> None:
        self.pid, self.every_s, self.sent = pid, every_s, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                os.kill(self.pid, signal.SIGHUP)
            except ProcessLookupError:
                return
            self.sent += 1
            self.done.wait(self.every_s)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def test_hups_from_the_first_instruction_to_the_last(tmp_path: Path) -> None:
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 2,
        "workers": {"command": ["python", "-c", "import time; time.sleep(3600)", "{rank}"]},
        "placement": {"rank_roles": {}, "on_shortage": "share", "engine": {"enabled": False}},
    }
    config = tmp_path / "hup.toml"
    config.write_text(to_toml(doc))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    instance = f"hup-{uuid.uuid4().hex[:8]}"
    env = daemon_env(**{INSTANCE_ENV: instance, "RUNTIME_DIRECTORY": str(run_dir)})
    lock = run_dir / lock_name(instance)
    spawned = time.monotonic()
    with DaemonProcess(config, tmp_path / "d.log", env=env, new_session=True) as d:
        # The first disposition other than the default: the entry point's ignore,
        # before the heavy imports (today: the handler, after them).
        first = None
        while first is None and time.monotonic() - spawned < 10:
            first = _disposition(d.pid)
        assert first == "ignored", f"SIGHUP first {first}:\n{d.tail()}"
        storm = Storm(d.pid, 0.01)
        time.sleep(max(0.0, 3.0 - (time.monotonic() - spawned)))
        storm.stop()
        assert d.proc.poll() is None, f"died of the HUPs ({storm.sent} sent):\n{d.tail()}"
        poll(d.running, timeout_s=60, what="the daemon running after the HUP storm")
        assert lock.exists()
        # The stop, in a storm of HUPs until the process is gone.
        stop_storm = Storm(d.pid, 0.002)
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(timeout=60)
        stop_storm.stop()
        d.stop()
    log = d.log.read_text(errors="replace")
    assert code == 0, f"exit {code} ({stop_storm.sent} HUPs in the stop):\n{log[-4000:]}"
    assert storm.sent > 100 and stop_storm.sent >= 3, (storm.sent, stop_storm.sent)
    assert "stopped" in log, log[-4000:]
    assert not lock.exists(), log[-4000:]
