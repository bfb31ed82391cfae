"""Real Ray as the engine (`[engine] kind = "auto"`, recognised from `ray start`):
the supervisor runs `ray start --head --block` on loopback; a driver creates two
actors named as vLLM's Ray workers (`RayWorkerWrapper`, vllm/v1/executor/
ray_utils.py), which the raylet starts as `ray::RayWorkerWrapper` processes
below itself. They are in the engine's tree, stay the engine's (no device held
open here: a Ray worker becomes a rank only by the device it opened; ranked by
device in tests/trees/test_ray_devices.py), and end with the engine when the
supervisor stops.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from tests.support.children import alive
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    free_port,
)
from tests.support.poll import poll
from tests.support.ray_support import (
    RAY,
    below_raylet,
    engine_running,
    engine_tree,
    ray_config,
    start_driver,
    stop_driver,
    title,
)


def test_ray_actors_are_in_the_engine_s_tree_and_end_with_it(tmp_path: Path) -> None:
    assert Path(RAY).exists(), "ray is installed by .ci/setup"
    # Ray's unix sockets live under --temp-dir: keep the path short (108 bytes).
    temp_dir = tempfile.mkdtemp(prefix="ps-ray-", dir="/tmp")
    port = free_port()
    driver: subprocess.Popen[str] | None = None
    try:
        config = ray_config(tmp_path, temp_dir, port)
        env = daemon_env(**{INSTANCE_ENV: f"ray-{uuid.uuid4().hex[:8]}"})
        with DaemonProcess(config, tmp_path / "d.log", env=env) as d:
            doc = poll(lambda: engine_running(d), timeout_s=60, what="ray start running")
            engine_pid = doc["engine"]["pid"]
            driver, actors = start_driver(port, ["-", "-"])
            assert len(actors) == 2, d.tail()
            for pid in actors:
                assert title(pid) == "ray::RayWorkerWrapper", title(pid)
            tree = poll(
                lambda: (t := engine_tree(d)) and set(actors) <= set(t) and t,
                timeout_s=30,
                what="the actors in the engine's tree",
            )
            for pid in actors:
                assert below_raylet(tree, pid, engine_pid), (pid, tree[pid], tree)
            # No device held open: no rank, and no conflict.
            now = d.placement() or doc
            assert now["ranks"][0]["state"] == "waiting"
            assert not d.events("rank_conflict")
            code = d.stop(timeout_s=60)
        assert code == 0, d.tail()
        assert not any(alive(pid) for pid in actors), "an actor outlived the supervisor"
        assert not alive(engine_pid)
    finally:
        stop_driver(driver)
        shutil.rmtree(temp_dir, ignore_errors=True)
