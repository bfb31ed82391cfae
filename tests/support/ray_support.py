"""Real Ray (`ray start --head --block`) as the engine, for tests: its config, the
driver that creates actors named as vLLM's, and a private /dev to hold "GPUs".

Does I/O: starts the driver as a subprocess and reads /proc. PRIVATE_DEV is a
shell script, run between `unshare --mount` and the daemon's exec, that gives
the daemon (and so Ray and its actors) a /dev of its own with nvidia0/nvidia1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.daemon_support import REPO, DaemonProcess, to_toml

RAY = str(Path(sys.executable).parent / "ray")

# Actors with the class name of vLLM's Ray workers (vllm/v1/executor/ray_utils.py
# RayWorkerWrapper). Each opens the device named for it (none: "-") and keeps the
# fd, as a worker's CUDA context keeps its /dev/nvidiaN open. Prints their pids.
DRIVER = r"""
import os, sys, time
import ray
ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_cpus=0)
class RayWorkerWrapper:
    def __init__(self, device):
        self.device_fd = None if device == "-" else os.open(device, os.O_RDWR)

    def pid(self):
        return os.getpid()

actors = [RayWorkerWrapper.remote(d) for d in sys.argv[2:]]
pids = ray.get([a.pid.remote() for a in actors], timeout=120)
print(" ".join(map(str, pids)), flush=True)
time.sleep(3600)
"""

# Run as `unshare --mount --propagation private sh -c PRIVATE_DEV devns CMD...`:
# builds a tmpfs with the host's basic nodes bound in (null, zero, full, random,
# urandom, tty, ptmx and pts), a fresh /dev/shm (Ray's object store), the fd
# links, and nvidia0/nvidia1 made with /dev/null's numbers (1:3: openable with
# no driver; discovery finds them by their nodes), moves it onto /dev, and
# execs CMD (same pid). The host's own /dev is not touched: the mounts are
# private to the new mount namespace (unshare(1), mount_namespaces(7)).
PRIVATE_DEV = r"""
set -eu
stage=$(mktemp -d /tmp/ps-devns-XXXXXX)
mount -t tmpfs -o mode=755,nosuid tmpfs "$stage"
for n in null zero full random urandom tty ptmx; do
  : > "$stage/$n"
  mount --bind "/dev/$n" "$stage/$n"
done
mkdir "$stage/pts" "$stage/shm"
mount --bind /dev/pts "$stage/pts"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$stage/shm"
ln -s /proc/self/fd "$stage/fd"
ln -s /proc/self/fd/0 "$stage/stdin"
ln -s /proc/self/fd/1 "$stage/stdout"
ln -s /proc/self/fd/2 "$stage/stderr"
for n in 0 1; do mknod -m 666 "$stage/nvidia$n" c 1 3; done
mount --move "$stage" /dev
rmdir "$stage"
exec "$@"
"""
PRIVATE_DEV_PREFIX = (
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    PRIVATE_DEV,
    "devns",
)


def ray_config(tmp_path: Path, temp_dir: str, port: int, **top: Any) -> Path:
    """`ray start --head --block` on loopback with one CPU and no dashboard, its
    workers named by the engine's kind; `top` adds or replaces top-level keys."""
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
    doc.update(top)
    doc = {k: v for k, v in doc.items() if v is not None}
    path = tmp_path / "ray.toml"
    path.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 0.5\n")
    return path


def start_driver(port: int, devices: Sequence[str]) -> tuple[subprocess.Popen[str], list[int]]:
    """The driver, one actor per entry of `devices` (a node to hold open, or "-");
    returns it (still running: it keeps the actors) and the actors' pids."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(REPO)
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, f"127.0.0.1:{port}", *devices],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert driver.stdout is not None
    line = driver.stdout.readline()  # the actors answered (Ray's own timeout: 120 s)
    return driver, [int(p) for p in line.split()]


def stop_driver(driver: subprocess.Popen[str] | None) -> None:
    if driver is not None:
        driver.kill()
        driver.wait(timeout=30)


def title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def engine_running(d: DaemonProcess) -> dict[str, Any] | None:
    doc = d.placement()
    return doc if doc and doc["engine"]["state"] == "running" and doc["engine"]["pid"] else None


def engine_tree(d: DaemonProcess) -> dict[int, dict[str, Any]]:
    """{pid: entry} of the engine's children as GET /placement lists them."""
    doc = d.placement() or {"engine": {"children": []}}
    return {c["pid"]: c for c in doc["engine"]["children"]}


def below_raylet(tree: dict[int, dict[str, Any]], pid: int, engine_pid: int) -> bool:
    """`pid` descends from the raylet in `tree` (or the engine is the raylet)."""
    raylet = {p for p, c in tree.items() if "raylet" in c["cmdline"]}
    ppid = tree[pid]["ppid"]
    chain = {ppid}
    while ppid in tree:
        ppid = tree[ppid]["ppid"]
        chain.add(ppid)
    return any(r in chain | {engine_pid} for r in raylet)
