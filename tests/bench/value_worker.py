"""The value bench's decode-step stand-in (I/O: files in OUT_DIR).

    python -m tests.bench.value_worker OUT_DIR WORK STEPS

Each step runs `step_work(WORK)` on the main thread (the CPU side of a decode
step: scheduling, input preparation, kernel launches), then waits 1 ms, as
for the device. Three helper threads wake every 5 ms for a sliver of work
(an output thread, a heartbeat, a collective's progress thread). Writes
OUT_DIR/worker.armed after a warm-up, waits for OUT_DIR/go, times STEPS
steps, writes their seconds to OUT_DIR/steps.json and sleeps until killed
(or LIFETIME_S, so it never outlives a bench that died).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

DEVICE_WAIT_S = 0.001
HELPERS = 3
HELPER_PERIOD_S = 0.005
WARMUP_STEPS = 50
LIFETIME_S = 900.0


def step_work(n: int) -> int:
    """A fixed amount of pure-Python work: the same instructions every step."""
    acc = 0
    for i in range(n):
        acc = (acc + i * i) & 0xFFFF
    return acc


def helper() -> None:
    while True:
        time.sleep(HELPER_PERIOD_S)
        step_work(200)


def step(work: int) -> float:
    t0 = time.perf_counter()
    step_work(work)
    time.sleep(DEVICE_WAIT_S)
    return time.perf_counter() - t0


def main() -> None:
    out, work, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for _ in range(HELPERS):
        threading.Thread(target=helper, daemon=True).start()
    for _ in range(WARMUP_STEPS):
        step(work)
    (out / "worker.armed").write_text(str(os.getpid()))
    go = out / "go"
    while not go.exists():  # the bench creates it once every process of the case runs
        time.sleep(0.001)
    times = [step(work) for _ in range(steps)]
    part = out / "steps.json.part"
    part.write_text(json.dumps(times))
    part.rename(out / "steps.json")
    time.sleep(LIFETIME_S)


if __name__ == "__main__":
    main()
