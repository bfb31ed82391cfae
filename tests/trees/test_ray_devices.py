"""Real Ray ranked by the device its actors hold open (`[engine] kind = "auto"`,
recognised from `ray start`; the `device` rule, docs/engine-kinds.md "Ray").

The daemon starts in a mount namespace of its own whose /dev is a tmpfs with
nvidia0 and nvidia1 made as /dev/null's numbers (tests/support/ray_support.py
PRIVATE_DEV); the host's /dev is not touched. Discovery finds two "GPUs" by
their nodes, and `ray start --head --block`, its raylet and the actors it
starts share that /dev. A driver (on loopback, outside the namespace) creates
two `RayWorkerWrapper` actors (vLLM's class name, vllm/v1/executor/ray_utils.py):
the first opens /dev/nvidia1, the second /dev/nvidia0, and each keeps it open.
Each actor must be the rank of the device it holds, every thread on that
rank's CPUs, in the engine's tree below the raylet; at SIGTERM every process
of the namespace ends with the supervisor.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from supervisor.cpulist import format_cpulist
from tests.support.children import alive, thread_cpus
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    free_port,
)
from tests.support.poll import poll
from tests.support.ray_support import (
    PRIVATE_DEV_PREFIX,
    RAY,
    below_raylet,
    engine_running,
    engine_tree,
    ray_config,
    start_driver,
    stop_driver,
    title,
)

# unshare(1) and mount(2) into a new mount namespace need CAP_SYS_ADMIN.
pytestmark = pytest.mark.root


def mount_ns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return ""


def in_namespace(ns: str) -> list[int]:
    """The live processes whose mount namespace is `ns`."""
    return [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and mount_ns(int(p)) == ns and alive(int(p))
    ]


def test_ray_actors_are_ranked_by_the_device_they_hold_open(
    tmp_path: Path, need_root: None
) -> None:
    assert Path(RAY).exists(), "ray is installed by .ci/setup"
    temp_dir = tempfile.mkdtemp(prefix="ps-ray-", dir="/tmp")  # short: unix socket paths
    port = free_port()
    driver: subprocess.Popen[str] | None = None
    try:
        # Ranks by accelerator (the two nodes), not cpu_ranks.
        config = ray_config(tmp_path, temp_dir, port, cpu_ranks=None, accelerator="nvidia")
        env = daemon_env(**{INSTANCE_ENV: f"raydev-{uuid.uuid4().hex[:8]}"})
        with DaemonProcess(config, tmp_path / "d.log", env=env, prefix=PRIVATE_DEV_PREFIX) as d:
            doc = poll(lambda: engine_running(d), timeout_s=90, what="ray start running")
            engine_pid = doc["engine"]["pid"]
            ns = mount_ns(d.pid)
            assert ns and ns != mount_ns(os.getpid()), "the daemon has a mount namespace of its own"
            assert os.stat(f"/proc/{d.pid}/root/dev/nvidia1").st_rdev == os.makedev(1, 3)
            assert [r["rank"] for r in doc["ranks"]] == [0, 1], doc["ranks"]
            # Actor a holds /dev/nvidia1, actor b /dev/nvidia0.
            driver, actors = start_driver(port, ["/dev/nvidia1", "/dev/nvidia0"])
            assert len(actors) == 2, d.tail()
            for pid in actors:
                assert title(pid) == "ray::RayWorkerWrapper", title(pid)
                assert mount_ns(pid) == ns, "the raylet's actors share the engine's /dev"
            want = {1: actors[0], 0: actors[1]}

            def ranked() -> dict[str, Any] | None:
                now = d.placement()
                if now and all(
                    r["state"] == "running" and r.get("adopted") and r["pid"] for r in now["ranks"]
                ):
                    return now
                return None

            doc = poll(ranked, timeout_s=60, interval_s=0.5, what="both ranks adopted")
            got = {r["rank"]: r["pid"] for r in doc["ranks"]}
            assert got == want, (got, want, d.tail())
            for r in doc["ranks"]:
                cpus = format_cpulist(r["cpus"])
                poll(
                    lambda r=r, cpus=cpus: set(thread_cpus(r["pid"]).values()) == {cpus},
                    timeout_s=30,
                    interval_s=0.5,
                    what=f"every thread of rank {r['rank']} on {cpus}",
                )
            # An adopted rank leaves the engine's children for its own entry,
            # which names its parent: the raylet (or a process below it).
            tree = engine_tree(d)
            for r in doc["ranks"]:
                assert r["ppid"] in tree, (r["rank"], r["ppid"], tree)
                tree[r["pid"]] = {"ppid": r["ppid"], "cmdline": title(r["pid"])}
            for pid in actors:
                assert below_raylet(tree, pid, engine_pid), (pid, tree[pid], tree)
            assert not d.events("rank_conflict")
            code = d.stop(timeout_s=60)
        assert code == 0, d.tail()
        left = in_namespace(ns)
        assert not left, f"left after the stop: {[(p, title(p)) for p in left]}"
        assert not any(alive(pid) for pid in [*actors, engine_pid, *tree])
    finally:
        stop_driver(driver)
        shutil.rmtree(temp_dir, ignore_errors=True)
