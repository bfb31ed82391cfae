"""What the start-up hook costs a Python process of the engine's tree, in one run.

    .venv/bin/python -m tests.bench.hook_bench [--runs N]

Measured inside the child, so the shared machine's process start-up noise
stays out (whole-interpreter start-up here varies 60-1300 ms under load):
  start-up   `python -X importtime -c pass`: the hook's own import time (the
             `sitecustomize` line), with its directory on PYTHONPATH but the
             hook variable unset (chain only), and active below this process
             (ancestry walk, meta-path finder); beside the interpreter's whole
             `site` import, the baseline.
  pools      in one process: create a pool in a listed module and run one
             task on it, twice, hooked vs not. The first pays the slot parse
             (json) and prctl (ctypes) imports once; the second shows what
             every later pool thread costs (naming, cgroup read, binding).
Modes alternate run by run. Prints medians in ms and ratios; no absolute
thresholds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from supervisor.hook import HOOK_ENV, hook_env
from supervisor.worker import SLOT_ENV, slot_env_value

REPO = Path(__file__).resolve().parents[2]
POOLS = "tests.support.fake_engine.pools"
POOL_PROGRAM = (
    "import time\n"
    "from concurrent.futures import ThreadPoolExecutor\n"
    "from tests.support.fake_engine import pools\n"
    "for _ in range(2):\n"
    "    t0 = time.perf_counter()\n"
    "    pool = pools.make_pool(4)\n"
    "    pool.submit(int).result()\n"
    "    print(time.perf_counter() - t0)\n"
)


def environments() -> dict[str, dict[str, str]]:
    base = {k: v for k, v in os.environ.items() if k not in (HOOK_ENV, SLOT_ENV)}
    base["PYTHONPATH"] = str(REPO)
    cpus = sorted(os.sched_getaffinity(0))
    # so_compiler = every CPU this process has: the bind is a real syscall but
    # moves nothing, so the run queue of one CPU on a loaded box stays out.
    base[SLOT_ENV] = slot_env_value(
        "engine", {"cpus": cpus, "mems": [0], "roles": {"so_compiler": cpus}}
    )
    active = {**base, **hook_env(base, {"so_compiler": (POOLS,)}, os.getpid())}
    on_path = {k: v for k, v in active.items() if k != HOOK_ENV}
    return {"plain": base, "on-path": on_path, "active": active}


def import_times(env: dict[str, str]) -> dict[str, float]:
    """Cumulative import seconds of `site` and `sitecustomize` in `python -c pass`."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    out = {"site": 0.0, "sitecustomize": 0.0}
    for line in done.stderr.splitlines():
        _, _, rest = line.partition("import time:")
        parts = [p.strip() for p in rest.split("|")]
        if len(parts) == 3 and parts[2] in out and parts[1].isdigit():
            out[parts[2]] = int(parts[1]) / 1e6
    return out


def pool_times(env: dict[str, str]) -> tuple[float, float]:
    done = subprocess.run(
        [sys.executable, "-c", POOL_PROGRAM],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    first, second = (float(word) for word in done.stdout.split()[-2:])
    return first, second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    envs = environments()
    site: list[float] = []
    hook: dict[str, list[float]] = {"on-path": [], "active": []}
    pools: dict[str, list[tuple[float, float]]] = {"plain": [], "active": []}
    for _ in range(args.runs):
        site.append(import_times(envs["plain"])["site"])
        for name, values in hook.items():
            values.append(import_times(envs[name])["sitecustomize"])
        for name in ("plain", "active"):
            pools[name].append(pool_times(envs[name]))
    ms = 1e3
    site_ms = statistics.median(site) * ms
    print(f"start-up hook, {args.runs} runs each, medians in ms")
    print(f"{'site import (baseline, no hook)':<40} {site_ms:7.2f}")
    for name, values in hook.items():
        value = statistics.median(values) * ms
        print(f"{'sitecustomize import, ' + name:<40} {value:7.2f}  ({value / site_ms:.3f} x site)")
    for i, which in enumerate(("first", "second")):
        plain = statistics.median(t[i] for t in pools["plain"]) * ms
        active = statistics.median(t[i] for t in pools["active"]) * ms
        print(f"{which + ' pool + task, unhooked':<40} {plain:7.2f}")
        print(f"{which + ' pool + task, hooked':<40} {active:7.2f}  ({active / plain:.2f} x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
