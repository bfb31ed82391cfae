"""The shipped Ray config (configs/engines/ray.toml) with real Ray: its stop
settings outlast Ray's SIGTERM drain, so the supervisor never SIGKILLs a node.

Only what this host cannot be is changed: the command starts a head on
loopback instead of joining `head.example:6379`, `accelerator` is `cpu`, and
the placement fits two CPUs. The stop settings, the engine's environment (the
drain pinned at 30 s) and its kind are the file's own. A driver keeps an actor
alive, so the raylet has work when the TERM comes.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any

from tests.support.children import alive
from tests.support.daemon_support import (
    INSTANCE_ENV,
    REPO,
    DaemonProcess,
    daemon_env,
    free_port,
    to_toml,
)
from tests.support.poll import poll
from tests.support.ray_support import engine_running, ray_config, start_driver, stop_driver

SHIPPED = REPO / "configs/engines/ray.toml"


def shipped_on_this_host(tmp_path: Path, temp_dir: str, port: int) -> tuple[Path, dict[str, Any]]:
    doc = tomllib.loads(SHIPPED.read_text())
    local = tomllib.loads(ray_config(tmp_path, temp_dir, port).read_text())
    run = dict(doc)
    run["accelerator"] = "cpu"
    run["cpu_ranks"] = 1
    run["engine"] = {**doc["engine"], "command": local["engine"]["command"]}
    run["engine"]["env"] = {**doc["engine"]["env"], **local["engine"]["env"]}
    run["placement"] = local["placement"]
    run["irq"] = {"enabled": False}
    run.pop("api", None)  # DaemonProcess gives --listen
    path = tmp_path / "shipped-ray.toml"
    path.write_text(to_toml(run))
    return path, doc


def test_the_shipped_ray_config_stops_real_ray_without_a_kill(tmp_path: Path) -> None:
    temp_dir = tempfile.mkdtemp(prefix="ps-ray-", dir="/tmp")
    port = free_port()
    driver = None
    try:
        config, doc = shipped_on_this_host(tmp_path, temp_dir, port)
        env = daemon_env(**{INSTANCE_ENV: f"ray-{uuid.uuid4().hex[:8]}"})
        d = DaemonProcess(config, tmp_path / "d.log", env=env)
        running = poll(lambda: engine_running(d), timeout_s=90, what="ray start running")
        engine_pid = running["engine"]["pid"]
        driver, actors = start_driver(port, ["-"])
        assert len(actors) == 1, d.tail()
        started = time.monotonic()
        code = d.stop(timeout_s=doc["stop_grace_s"] + 30)
        took = time.monotonic() - started
        log = d.tail(20000)
        assert code == 0, log
        exits = re.findall(r"exit rank=engine pid=\d+ exit_code=(-?\d+)", log)
        assert exits, log
        # Not killed (-9 from the runner's reaping, 137 from a shell): Ray ended
        # within the file's stop_timeout_s, drain and teardown included.
        assert int(exits[-1]) not in (-9, 137), log
        assert took < doc["stop_timeout_s"], f"stop took {took:.1f} s: {log[-2000:]}"
        assert not alive(engine_pid)
        assert not any(alive(pid) for pid in actors), "an actor outlived the supervisor"
    finally:
        stop_driver(driver)
        shutil.rmtree(temp_dir, ignore_errors=True)
