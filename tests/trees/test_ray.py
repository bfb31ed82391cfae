"""Real Ray as the engine (`[engine] kind = "auto"`, recognised from `ray start`):
the supervisor runs `ray start --head --block` on loopback; a driver creates two
actors named as vLLM's Ray workers (`RayWorkerWrapper`, vllm/v1/executor/
ray_utils.py), which the raylet starts as `ray::RayWorkerWrapper` processes
below itself. They are in the engine's tree, stay the engine's (no device held
open here: a Ray worker becomes a rank only by the device it opened), and end
with the engine when the supervisor stops.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from tests.support.daemon_support import (
    INSTANCE_ENV,
    REPO,
    DaemonProcess,
    daemon_env,
    poll,
    to_toml,
)

RAY = str(Path(sys.executable).parent / "ray")

DRIVER = r"""
import os, sys, time
import ray
ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_cpus=0)
class RayWorkerWrapper:
    def pid(self):
        return os.getpid()

actors = [RayWorkerWrapper.remote() for _ in range(2)]
pids = ray.get([a.pid.remote() for a in actors], timeout=120)
print(" ".join(map(str, pids)), flush=True)
time.sleep(3600)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ray_config(tmp_path: Path, temp_dir: str, port: int) -> Path:
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "auto",
        "stop_timeout_s": 10,
        "engine": {
            "command": [
                RAY,
                "start",
                "--head",
                "--block",
                "--node-ip-address",
                "127.0.0.1",
                "--port",
                str(port),
                "--num-cpus",
                "1",
                "--include-dashboard",
                "false",
                "--disable-usage-stats",
                "--temp-dir",
                temp_dir,
                "--object-store-memory",
                str(100 * 1024 * 1024),
            ],
            "env": {"RAY_USAGE_STATS_ENABLED": "0"},
        },
        "workers": {"spawned_by": "engine", "waiting_warning_s": 600},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
    }
    path = tmp_path / "ray.toml"
    path.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 0.5\n")
    return path


def title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def engine_running(d: DaemonProcess) -> dict[str, Any] | None:
    doc = d.placement()
    return doc if doc and doc["engine"]["state"] == "running" and doc["engine"]["pid"] else None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
            driver_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
            driver_env["PYTHONPATH"] = str(REPO)
            driver = subprocess.Popen(
                [sys.executable, "-c", DRIVER, f"127.0.0.1:{port}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=driver_env,
            )
            assert driver.stdout is not None
            line = driver.stdout.readline()  # the actors answered (Ray's own timeout: 120 s)
            actors = [int(p) for p in line.split()]
            assert len(actors) == 2, (line, d.tail())
            for pid in actors:
                assert title(pid) == "ray::RayWorkerWrapper", title(pid)

            def in_tree() -> bool:
                now = d.placement()
                pids = {
                    c["pid"] for c in (now or {"engine": {"children": []}})["engine"]["children"]
                }
                return set(actors) <= pids

            poll(in_tree, timeout_s=30, what="the actors in the engine's tree")
            now = d.placement() or doc
            raylet = [c for c in now["engine"]["children"] if "raylet" in c["cmdline"]]
            assert raylet, now["engine"]["children"]
            by_pid = {c["pid"]: c for c in now["engine"]["children"]}
            for pid in actors:
                # The actors are the raylet's descendants.
                ppid = by_pid[pid]["ppid"]
                chain = {ppid}
                while ppid in by_pid:
                    ppid = by_pid[ppid]["ppid"]
                    chain.add(ppid)
                assert raylet[0]["pid"] in chain | {engine_pid}, (pid, by_pid[pid])
            # No device held open: no rank, and no conflict.
            assert now["ranks"][0]["state"] == "waiting"
            assert not d.events("rank_conflict")
            code = d.stop(timeout_s=60)
        assert code == 0, d.tail()
        assert not any(alive(pid) for pid in actors), "an actor outlived the supervisor"
        assert not alive(engine_pid)
    finally:
        if driver is not None:
            driver.kill()
            driver.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
