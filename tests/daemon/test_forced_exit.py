"""A second SIGTERM during the stop: a real daemon whose worker ignores SIGTERM
(so the ordered stop would wait its whole stop_timeout_s) exits at once when
told twice, says so in its log, and leaves no worker behind.
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from typing import Any

from supervisor.daemon.root import FORCED_EXIT_BASE
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    poll,
    rank_pids,
    to_toml,
)

STOP_TIMEOUT_S = 120  # what the ordered stop would wait on the deaf worker
# Deaf to SIGTERM, and says so (the file) once it is: until then a TERM kills it.
DEAF_WORKER = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(sys.argv[1], 'w').close(); time.sleep(3600)"
)


def _gone(pid: int) -> bool:
    """No such process, or a zombie that init has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_second_sigterm_during_the_stop_exits_at_once(tmp_path: Path) -> None:
    deaf = tmp_path / "deaf"
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": STOP_TIMEOUT_S,
        "workers": {"command": ["python", "-c", DEAF_WORKER, str(deaf)]},
        "placement": {"rank_roles": {}, "on_shortage": "share", "engine": {"enabled": False}},
    }
    config = tmp_path / "forced.toml"
    config.write_text(to_toml(doc))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = daemon_env(
        **{INSTANCE_ENV: f"forced-{uuid.uuid4().hex[:8]}", "RUNTIME_DIRECTORY": str(run_dir)}
    )
    with DaemonProcess(config, tmp_path / "d.log", env=env, new_session=True) as d:
        running = poll(d.running, timeout_s=60, what="the daemon running")
        (worker,) = rank_pids(running).values()
        poll(deaf.exists, timeout_s=30, what="the worker deaf to SIGTERM")
        d.proc.send_signal(signal.SIGTERM)
        # The ordered stop has begun (its event), and waits on the deaf worker.
        poll(lambda: d.events("stopping"), timeout_s=30, what="the stop under way")
        assert d.proc.poll() is None, d.tail()
        told = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(timeout=STOP_TIMEOUT_S / 4)
        took_s = time.monotonic() - told
        log = d.tail()
        assert code == FORCED_EXIT_BASE + signal.SIGTERM, f"exit {code}:\n{log}"
        assert took_s < 10, f"{took_s:.1f} s to exit:\n{log}"
        assert "forced exit" in log and "signal=SIGTERM" in log, log
        assert "stopped" not in log.rsplit("forced exit", 1)[1], log  # not the ordered end
        # The worker ignored SIGTERM; the kernel's PDEATHSIG and the guardian end it.
        poll(lambda: _gone(worker), timeout_s=10, what=f"worker {worker} gone")
