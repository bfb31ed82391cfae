"""Child programs the tests run, and what /proc says about a running process.

Does I/O: starts real processes and reads /proc. The programs are Python
source strings (run with `python -c SRC` or written to a file); those that
import `supervisor` need the repository as their working directory.

- `REPORTING_CHILD`: writes where it runs (affinity, memory policy, env) as
  JSON into a directory, one file per start (`write_child`, `reports`).
- `NAMED_THREADS_CHILD`: named threads, one pinned, one started late on a
  trigger file; reports its thread ids the same way.
- `COMM_THREADS_WORKER`: N threads named comm-0..; sleeps.
- `ThreadedChild`: a live process with named threads and touched memory,
  driven over stdin ("spawn NAME" / "stop NAME").
- `start_shimmed`: a command through the exec shim, with its report read.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from supervisor.bind.report import ShimReport, parse_shim_report, shim_argv
from supervisor.cpulist import parse_cpulist
from tests.support.poll import poll

# argv: out-dir, key, mode. First action: report what the kernel says about
# us. mode "crash" (or "crash-rank-KEY" for that key) exits 3; "ready-file"
# touches <out>/engine.ready after 0.3 s; then sleeps.
REPORTING_CHILD = r"""
import json, os, signal, sys, time

out, key, mode = sys.argv[1], sys.argv[2], sys.argv[3]
# First action: report what the kernel says about us.
status = open("/proc/self/status").read()
fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
maps = open("/proc/self/numa_maps").read().split("\n")
doc = {
    "pid": os.getpid(),
    "key": key,
    "cpus": sorted(os.sched_getaffinity(0)),
    "cpus_allowed_list": fields.get("Cpus_allowed_list", "").strip(),
    "mems_allowed_list": fields.get("Mems_allowed_list", "").strip(),
    "policy": maps[0].split()[1] if maps and maps[0] else "?",
    "env": {k: v for k, v in os.environ.items() if k in (
        "PLACEMENT_SUPERVISOR_SLOT", "CUDA_VISIBLE_DEVICES", "NOTIFY_SOCKET",
        "WATCHDOG_USEC", "DEMO_DEFAULT", "DEMO_FORCED")},
}
tmp = os.path.join(out, f"{key}-{os.getpid()}.tmp")
with open(tmp, "w") as f:
    json.dump(doc, f)
os.rename(tmp, tmp[:-4] + ".json")
if mode == "crash" or (mode.startswith("crash-rank-") and key == mode[len("crash-rank-"):]):
    sys.exit(3)
if mode == "ready-file":
    time.sleep(0.3)
    open(os.path.join(out, "engine.ready"), "w").close()
while True:
    time.sleep(3600)
"""

# A worker with named threads. argv: out-dir, key, spec file (JSON):
# {"threads": [names], "pin": {"name": n, "cpus": [..]}, "late": name}.
# Writes <out>/<key>-<pid>.json = {"pid", "threads": {name: tid}} once its
# threads run, and again after starting `late` when <out>/<key>.late appears.
NAMED_THREADS_CHILD = r"""
import json, os, sys, threading, time
from supervisor.worker import set_thread_name

out, key = sys.argv[1], sys.argv[2]
with open(sys.argv[3]) as f:
    spec = json.load(f)
tids = {"main": threading.get_native_id()}
lock = threading.Lock()
started = threading.Semaphore(0)

def body(name, cpus=None):
    set_thread_name(name)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    with lock:
        tids[name] = threading.get_native_id()
    started.release()
    while True:
        time.sleep(3600)

def start(name, cpus=None):
    threading.Thread(target=body, args=(name, cpus), daemon=True).start()
    started.acquire()

def report():
    path = os.path.join(out, f"{key}-{os.getpid()}.json")
    with lock:
        doc = {"pid": os.getpid(), "threads": dict(tids)}
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.rename(path + ".tmp", path)

for name in spec.get("threads", []):
    start(name)
pin = spec.get("pin")
if pin:
    start(pin["name"], pin["cpus"])
report()
late = spec.get("late")
trigger = os.path.join(out, f"{key}.late")
while late and not os.path.exists(trigger):
    time.sleep(0.02)
if late:
    start(late)
    report()
while True:
    time.sleep(3600)
"""

# A worker with named threads: argv = number of extra "comm-N" threads. It
# names them (prctl) and sleeps; nothing else.
COMM_THREADS_WORKER = r"""
import sys, threading, time
from supervisor.worker import set_thread_name

def body(name):
    set_thread_name(name)
    while True:
        time.sleep(3600)

for i in range(int(sys.argv[1])):
    threading.Thread(target=body, args=(f"comm-{i}",), daemon=True).start()
while True:
    time.sleep(3600)
"""

# argv[1]: JSON {"names": [...], "touch_bytes": n}. Starts one thread per
# name (each names its OS thread with prctl through supervisor.worker),
# optionally touches `touch_bytes` of anonymous memory, prints
# {"threads": {name: tid}} and then obeys "spawn NAME" / "stop NAME" lines on
# stdin (answering with a JSON line) until stdin closes.
THREADED_CHILD = r"""
import json, mmap, sys, threading
from supervisor.worker import set_thread_name

spec = json.loads(sys.argv[1])
touch = spec["touch_bytes"]
buf = None
if touch:
    buf = mmap.mmap(-1, touch)
    chunk = b"\x01" * (1 << 20)  # small: the chunk itself is resident too
    for off in range(0, touch, len(chunk)):
        buf.write(chunk[: min(len(chunk), touch - off)])
stops = {}
tids = {}
lock = threading.Lock()

def start(name):
    up = threading.Event()
    stop = threading.Event()
    def run():
        set_thread_name(name)
        with lock:
            tids[name] = threading.get_native_id()
        up.set()
        stop.wait()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    up.wait()
    stops[name] = (stop, t)

for name in spec["names"]:
    start(name)
print(json.dumps({"threads": tids}), flush=True)
for line in sys.stdin:
    cmd, _, name = line.strip().partition(" ")
    if cmd == "spawn":
        start(name)
        print(json.dumps({"tid": tids[name]}), flush=True)
    elif cmd == "stop":
        stop, t = stops.pop(name)
        stop.set()
        t.join()
        print(json.dumps({"tid": tids.pop(name)}), flush=True)
    elif cmd == "rename":  # "rename OLD NEW": a sibling may write a thread's comm
        old, new = name.split()
        with open(f"/proc/self/task/{tids[old]}/comm", "w") as f:
            f.write(new)
        tids[new] = tids.pop(old)
        stops[new] = stops.pop(old)
        print(json.dumps({"tid": tids[new]}), flush=True)
"""


# -- reporting children ---------------------------------------------------------------


def write_child(
    tmp_path: Path, program: str = REPORTING_CHILD, name: str = "child.py"
) -> tuple[Path, Path]:
    """`program` as a script in `tmp_path`, and the (new) directory it reports into."""
    script = tmp_path / name
    script.write_text(program)
    out = tmp_path / "reports"
    out.mkdir()
    return script, out


def reports(out: Path, key: str) -> list[dict[str, Any]]:
    """Every start's report for `key`, oldest first."""
    docs = []
    for path in out.glob(f"{key}-*.json"):
        docs.append(json.loads(path.read_text()))
    return sorted(docs, key=lambda d: os.stat(out / f"{key}-{d['pid']}.json").st_mtime_ns)


def report_of(out: Path, key: str, pid: int) -> dict[str, Any] | None:
    path = out / f"{key}-{pid}.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- a live process with named threads ---------------------------------------------------


def close_process(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL (if still running), reap, and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


class ThreadedChild:
    """A real process with named threads (and touched memory), for observation tests."""

    def __init__(
        self,
        names: Sequence[str],
        touch_bytes: int = 0,
        timeout_s: float = 60.0,
        wrapper: Sequence[str] = (),
    ) -> None:
        spec = json.dumps({"names": list(names), "touch_bytes": touch_bytes})
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-c", THREADED_CHILD, spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid
        try:
            self.threads: dict[str, int] = self._reply(timeout_s)["threads"]
        except BaseException:
            self.close()
            raise

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"child {self.pid} did not answer within {timeout_s}s")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"child {self.pid} exited: {self.proc.wait()}")
                reply: dict[str, Any] = json.loads(line)
                return reply

    def command(self, line: str, timeout_s: float = 30.0) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        tid = self._reply(timeout_s)["tid"]
        assert isinstance(tid, int)
        if line.startswith("stop "):
            # pthread_join returns once the kernel clears the thread's tid futex
            # (mm_release), a moment before the task is released and leaves
            # /proc/<pid>/task: wait for that, so "stopped" means gone from /proc.
            task = f"/proc/{self.pid}/task/{tid}"
            poll(lambda: not os.path.exists(task), timeout_s, what=f"{task} gone")
        return tid

    def close(self) -> None:
        close_process(self.proc)

    def __enter__(self) -> ThreadedChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- through the exec shim ------------------------------------------------------------


def read_all(fd: int) -> bytes:
    """Everything until EOF from `fd`, which is then closed."""
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


def start_shimmed(
    cpus: Sequence[int],
    mems: Sequence[int],
    command: Sequence[str],
    *,
    shim: dict[str, Any] | None = None,
    **popen: Any,
) -> tuple[subprocess.Popen[str], ShimReport]:
    """Start `command` through `shim_argv` (extra shim options in `shim`) and
    read the shim's report: it reaches EOF at the exec, so the command runs."""
    r, w = os.pipe()
    argv = shim_argv(sys.executable, cpus, mems, command, report_fd=w, **(shim or {}))
    proc = subprocess.Popen(argv, pass_fds=[w], text=True, **popen)
    os.close(w)
    return proc, parse_shim_report(read_all(r))


# -- /proc of a process ----------------------------------------------------------------


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (or dead): its /proc/<pid>/stat state."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def status_field(where: int | str, name: str) -> str:
    """A field of /proc/<where>/status (`where`: a pid, "self", "PID/task/TID")."""
    with open(f"/proc/{where}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    raise AssertionError(f"{name} not in /proc/{where}/status")


def mems_allowed() -> frozenset[int]:
    """This process's Mems_allowed_list."""
    return parse_cpulist(status_field("self", "Mems_allowed_list"))


def thread_cpus(pid: int) -> dict[int, str]:
    """Cpus_allowed_list of every thread of `pid` ({} once it is gone)."""
    out: dict[int, str] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out[int(tid)] = status_field(f"{pid}/task/{tid}", "Cpus_allowed_list")
        except OSError:
            continue
    return out
