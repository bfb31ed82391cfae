"""Real Ray actors ranked by the device they opened; run INSIDE the numavm guest (as root).

    ../shared/tools/numavm/run-in-vm --nodes 2 -- .venv/bin/python -u tests/vm_checks/ray_devices.py

The guest has no GPU, so two device nodes are made: /dev/nvidia0 and
/dev/nvidia1, character devices with /dev/null's numbers (1:3), so that a
process can open them (a node of the NVIDIA major 195 would give ENXIO with
no driver). Discovery finds the two "GPUs" by their nodes (the fallback when
/proc/driver/nvidia is absent). The supervisor runs `ray start --head
--block` (kind "auto" -> ray); a driver creates two RayWorkerWrapper actors,
the first opening /dev/nvidia1 and the second /dev/nvidia0 (creation order is
not device order). Each must become the rank of the device it holds open,
its threads on that rank's CPUs, and every actor must end with the engine.
Prints "PASS name: detail" / "FAIL name: detail" per check.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from supervisor.cpulist import format_cpulist  # noqa: E402
from tests.support.children import status_field  # noqa: E402
from tests.support.daemon_support import DaemonProcess, to_toml, wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402

CHECKS = Checklist()
RAY = str(Path(sys.executable).parent / "ray")

DRIVER = r"""
import os, sys, time
import ray
ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_cpus=0)
class RayWorkerWrapper:
    def open_device(self, path):
        self.fd = os.open(path, os.O_RDWR)  # as CUDA's context creation holds its GPU open
        return os.getpid()

actors = [RayWorkerWrapper.remote() for _ in range(2)]
pids = ray.get([a.open_device.remote(f"/dev/nvidia{1 - i}") for i, a in enumerate(actors)])
print(" ".join(map(str, pids)), flush=True)
time.sleep(3600)
"""


def make_nodes() -> None:
    for n in (0, 1):
        path = f"/dev/nvidia{n}"
        if not os.path.exists(path):
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> int:
    make_nodes()
    tmp = Path(tempfile.mkdtemp())
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    port = free_port()
    doc: dict[str, Any] = {
        "accelerator": "nvidia",
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
        },
        "workers": {"spawned_by": "engine"},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
        "drift": {"check_interval_s": 0.5},
    }
    config = tmp / "ray.toml"
    config.write_text(to_toml(doc))
    daemon = DaemonProcess(config, "/tmp/ray-daemon.log")
    driver: subprocess.Popen[str] | None = None
    actors: list[int] = []
    try:
        up = wait_until(lambda: (daemon.placement() or {}).get("engine", {}).get("pid"), 120)
        CHECKS.check("ray start running", bool(up), str(up))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, f"127.0.0.1:{port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert driver.stdout is not None
        actors = [int(p) for p in driver.stdout.readline().split()]
        CHECKS.check("two actors", len(actors) == 2, str(actors))
        holds = {1: actors[0], 0: actors[1]} if len(actors) == 2 else {}

        def ranked() -> dict[str, Any] | None:
            doc = daemon.placement()
            if doc and all(r["state"] == "running" and r.get("adopted") for r in doc["ranks"]):
                return doc
            return None

        doc = wait_until(ranked, 60, 0.2)
        CHECKS.check("both ranks adopted", bool(doc), str(doc and doc["ranks"]))
        if doc:
            got = {r["rank"]: r["pid"] for r in doc["ranks"]}
            CHECKS.check("ranked by the device held open", got == holds, f"{got} want {holds}")
            for r in doc["ranks"]:
                want = format_cpulist(r["cpus"])
                on = wait_until(
                    lambda r=r, want=want: all(
                        status_field(f"{r['pid']}/task/{t}", "Cpus_allowed_list") == want
                        for t in os.listdir(f"/proc/{r['pid']}/task")
                    ),
                    20,
                    0.2,
                )
                CHECKS.check(f"rank {r['rank']} threads on its CPUs", bool(on), want)
    except AssertionError as err:
        CHECKS.check("daemon up", False, str(err).replace("\n", " | "))
    finally:
        code = daemon.stop(timeout_s=60)
        CHECKS.check("clean stop", code == 0, f"exit {code}")
        CHECKS.check(
            "no actor left", not any(alive(p) for p in actors), str([alive(p) for p in actors])
        )
        if driver is not None:
            driver.kill()
            driver.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
        if CHECKS.failed:
            print("--- daemon log ---\n" + daemon.tail(6000), flush=True)
    return CHECKS.exit_code()


if __name__ == "__main__":
    sys.exit(main())
