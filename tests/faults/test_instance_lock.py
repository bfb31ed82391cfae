"""Issue 11 item 3: one daemon per config, with a real second daemon.

A second `run` of the same config (another --listen) must exit 2 before it
spawns anything or touches a cgroup, naming the first daemon's pid; once the
first stops (or dies), the config can run again.
"""

from __future__ import annotations

import signal
from pathlib import Path

from tests.support.children import reports, write_child
from tests.support.daemon_support import (
    DaemonProcess,
    child_config,
    daemon_env,
    entries,
    free_port,
    run_supervisor,
    to_toml,
)
from tests.support.poll import poll


def test_a_second_daemon_of_the_same_config_exits_2_naming_the_first(tmp_path: Path) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(to_toml(child_config(script, out, engine=True, cgroup="auto")))
    env = daemon_env(RUNTIME_DIRECTORY=str(tmp_path / "run"))
    with DaemonProcess(config, tmp_path / "first.log", env=env) as first:
        doc = poll(first.running, timeout_s=60)
        pids = {e["pid"] for e in entries(doc)}
        # Each child reports as its first action, just after "running".
        started = poll(lambda: len(list(out.glob("*.json"))) == 3 and 3, timeout_s=10)

        second = run_supervisor(
            "run",
            "--config",
            str(config),
            "--listen",
            f"127.0.0.1:{free_port()}",
            env=env,
            timeout_s=30,
        )
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert f"pid {first.pid}" in lines[0] and str(config) in lines[0]
        # It spawned nothing: no new child reported, the first's processes unchanged.
        assert len(list(out.glob("*.json"))) == started
        now = poll(first.running, timeout_s=10)
        assert {e["pid"] for e in entries(now)} == pids
        assert first.proc.poll() is None
        assert first.stop() == 0
    # The lock went with the first daemon: the config runs again.
    with DaemonProcess(config, tmp_path / "third.log", env=env) as third:
        poll(third.running, timeout_s=60)
        poll(lambda: len(reports(out, "engine")) == 2, timeout_s=10, what="a new engine")


def test_the_lock_does_not_outlive_a_killed_daemon(tmp_path: Path) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(to_toml(child_config(script, out)))
    env = daemon_env(RUNTIME_DIRECTORY=str(tmp_path / "run"))
    with DaemonProcess(config, tmp_path / "first.log", env=env) as first:
        doc = poll(first.running, timeout_s=60)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
    pids = [e["pid"] for e in entries(doc)]
    with DaemonProcess(config, tmp_path / "second.log", env=env) as second:
        now = poll(second.running, timeout_s=60)
        assert not {e["pid"] for e in entries(now)} & set(pids)
