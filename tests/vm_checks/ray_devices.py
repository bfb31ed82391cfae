"""Ranks named by the device node held open; run INSIDE the numavm guest (as root).

    ../shared/tools/numavm/run-in-vm --nodes 2 -- .venv/bin/python -u tests/vm_checks/ray_devices.py

The guest has no GPU, so two device nodes are made: /dev/nvidia0 and
/dev/nvidia1, character devices with /dev/null's numbers (1:3), so that a
process can open them (a node of the NVIDIA major 195 gives ENXIO without
the driver). Discovery finds the two "GPUs" by their nodes (the fallback
without /proc/driver/nvidia). Real Ray (2.60) does not start in this
emulated guest: every Ray Python process needs about 45 s for `import ray`
under TCG, and the raylet aborts (Check failed in
NodeManager::WaitForDashboardAgentPorts, "Timed out waiting for file
<session>/metrics_agent_port_<node>") about 24 s after starting its
dashboard agent: a fixed wait, not lifted by RAY_agent_register_timeout_ms;
with all four agent ports given to `ray start` it still waits for (and
times out on) <session>/dashboard_agent_listen_port_<node>. Real Ray's
tree, titles and cleanup are tested on the host (tests/trees/test_ray.py),
and real Ray ranked by device there too (tests/trees/test_ray_devices.py:
the same two nodes in a private /dev of the daemon's mount namespace). Here:
1. `[engine] kind = "ray"` with a stand-in shaped as `ray start --head
   --block` (tests/support/fake_engine/layouts.py ray_main): a raylet starts
   two workers, titled ray::IDLE then ray::RayWorkerWrapper, the first
   opening /dev/nvidia1, the second /dev/nvidia0. Each must be the rank of the
   device it holds, its threads on that rank's CPUs.
2. The device wins: the vLLM stand-in (-tp 2) whose worker titled _TP0 opens
   /dev/nvidia1 and _TP1 /dev/nvidia0: ranks by device, one rank_conflict each.
Prints "PASS name: detail" / "FAIL name: detail" per check.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from supervisor.cpulist import format_cpulist  # noqa: E402
from tests.support.children import alive, status_field  # noqa: E402
from tests.support.daemon_support import DaemonProcess, to_toml  # noqa: E402
from tests.support.fake_engine.layouts import OPEN_DEVICE_ENV  # noqa: E402
from tests.support.fake_engine.shims import records, write_shim  # noqa: E402
from tests.support.poll import wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402

CHECKS = Checklist()


def make_nodes() -> None:
    for n in (0, 1):
        path = f"/dev/nvidia{n}"
        if not os.path.exists(path):
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))


def run_case(
    name: str, module: str, main: str, *, kind: str, flags: list[str], env: dict[str, str]
) -> None:
    tmp = Path(tempfile.mkdtemp())
    write_shim(tmp / "shims", module, main)
    record = tmp / "record"
    record.mkdir()
    doc: dict[str, Any] = {
        "accelerator": "nvidia",
        "stop_timeout_s": 5,
        "engine": {
            "kind": kind,
            "command": ["python", "-m", module, *flags, "--record-dir", str(record)],
            "env": {"PYTHONPATH": f"{tmp / 'shims'}{os.pathsep}{REPO}", **env},
        },
        "workers": {"spawned_by": "engine"},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
        "drift": {"check_interval_s": 0.5},
    }
    config = tmp / f"{name}.toml"
    config.write_text(to_toml(doc))
    daemon = DaemonProcess(config, f"/tmp/{name}-daemon.log")
    drives: dict[int, int] = {}
    try:

        def ranked() -> dict[str, Any] | None:
            doc = daemon.placement()
            if (
                doc
                and len(records(record)) >= 2
                and all(r["state"] == "running" and r.get("adopted") for r in doc["ranks"])
            ):
                return doc
            return None

        doc = wait_until(ranked, 240, 0.5)
        CHECKS.check(f"{name} both ranks adopted", bool(doc), str(doc and doc["ranks"]))
        if doc:
            drives = records(record)
            got = {r["rank"]: r["pid"] for r in doc["ranks"]}
            CHECKS.check(
                f"{name} ranked by the device held open", got == drives, f"{got} want {drives}"
            )
            for r in doc["ranks"]:
                want = format_cpulist(r["cpus"])
                on = wait_until(
                    lambda r=r, want=want: all(
                        status_field(f"{r['pid']}/task/{t}", "Cpus_allowed_list") == want
                        for t in os.listdir(f"/proc/{r['pid']}/task")
                    ),
                    30,
                    0.5,
                )
                CHECKS.check(f"{name} rank {r['rank']} threads on its CPUs", bool(on), want)
            conflicts = daemon.events("rank_conflict")
            want_conflicts = 2 if OPEN_DEVICE_ENV in env else 0
            CHECKS.check(
                f"{name} conflicts reported",
                len(conflicts) == want_conflicts,
                "; ".join(e["message"] for e in conflicts) or "none",
            )
    except AssertionError as err:
        CHECKS.check(f"{name} daemon up", False, str(err).replace("\n", " | "))
    finally:
        code = daemon.stop(timeout_s=60)
        CHECKS.check(f"{name} clean stop", code == 0, f"exit {code}")
        left = [p for p in drives.values() if alive(p)]
        CHECKS.check(f"{name} no process left", not left, str(left))
        if CHECKS.failed:
            print("--- daemon log ---\n" + daemon.tail(4000), flush=True)


def main() -> int:
    make_nodes()
    run_case("ray", "raystandin", "ray_main", kind="ray", flags=["--workers", "2"], env={})
    run_case(
        "vllm",
        "vllmstandin",
        "vllm_main",
        kind="vllm",
        flags=["--tensor-parallel-size", "2"],
        env={OPEN_DEVICE_ENV: "reverse"},
    )
    return CHECKS.exit_code()


if __name__ == "__main__":
    sys.exit(main())
