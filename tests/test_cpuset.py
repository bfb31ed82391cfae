"""A cpuset change on this host (cgroup v1): the daemon re-plans and re-binds its ranks.

The daemon runs as a real subprocess (tests/vm_checks/checker_daemon.py)
confined to a v1 cpuset made for the test (cpus 0-1, mems 0), with one
per-rank cgroup per worker below it. The test plays the orchestrator: it
shrinks the supervisor's cpuset to CPU 1 (children first: the v1 kernel
refuses a parent below its children's CPUs with EBUSY) and grows it back,
and reads every worker thread's Cpus_allowed_list from /proc. Everything is
removed afterwards (processes stopped, tasks moved to the root cpuset,
cgroups rmdir'ed deepest first).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.cpulist import format_cpulist, parse_cpulist
from tests.daemon_support import free_port, to_toml

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = REPO / "tests/vm_checks/checker_daemon.py"  # joins the cgroup, execs the daemon
V1_CPUSET = Path("/sys/fs/cgroup/cpuset")
V1_MEMORY = Path("/sys/fs/cgroup/memory")
INSTANCE_ENV = "PLACEMENT_SUPERVISOR_INSTANCE"

# A worker with named threads: argv = number of extra "comm-N" threads. It
# names them (prctl) and sleeps; nothing else.
WORKER = r"""
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


# -- the orchestrator's side ------------------------------------------------------------


def v1_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if not (V1_CPUSET / "cpuset.cpus").exists():
        return "no cgroup v1 cpuset hierarchy at /sys/fs/cgroup/cpuset"
    if not {0, 1} <= os.sched_getaffinity(0):
        return "needs CPUs 0 and 1"
    return None


def _descendants_deepest_first(root: Path) -> list[Path]:
    dirs = [Path(d) for d, _, _ in os.walk(root)]
    return sorted((d for d in dirs if d != root), key=lambda d: -len(d.parts))


def write_v1_cpus(cgroup: Path, cpus: set[int]) -> None:
    """Set a v1 cpuset's CPUs the way an orchestrator must when it has children.

    Shrinking: v1 refuses a parent whose new CPUs leave out a child's (EBUSY),
    so every descendant shrinks first, deepest first, to its CPUs ∩ the new
    set (or the whole new set when that is empty). Growing needs nothing first.
    """
    for child in _descendants_deepest_first(cgroup):
        own = parse_cpulist((child / "cpuset.cpus").read_text())
        if not own or own <= cpus:
            continue
        (child / "cpuset.cpus").write_text(format_cpulist((own & cpus) or cpus))
    (cgroup / "cpuset.cpus").write_text(format_cpulist(cpus))


def remove_v1_tree(root: Path, hierarchy: Path) -> None:
    """Move every task of `root`'s tree to the hierarchy root, then rmdir deepest first."""
    if not root.exists():
        return
    for d in [*_descendants_deepest_first(root), root]:
        for name in ("cgroup.procs", "tasks"):
            with contextlib.suppress(OSError):
                for pid in (d / name).read_text().split():
                    with contextlib.suppress(OSError):
                        (hierarchy / "cgroup.procs").write_text(pid)
        deadline = time.monotonic() + 5
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # an exited task stays a member until reaped


@contextlib.contextmanager
def v1_cpuset(name: str, cpus: str = "0-1", mems: str = "0") -> Iterator[Path]:
    """A fresh v1 cpuset under the hierarchy root; removed with everything in it."""
    cg = V1_CPUSET / name
    remove_v1_tree(cg, V1_CPUSET)
    cg.mkdir()
    try:
        (cg / "cpuset.mems").write_text(mems)
        (cg / "cpuset.cpus").write_text(cpus)
        yield cg
    finally:
        remove_v1_tree(cg, V1_CPUSET)


def own_memory_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return V1_MEMORY / path.lstrip("/")
    return None


# -- the daemon as a subprocess -------------------------------------------------------------


class DaemonProcess:
    """The launcher in a subprocess, with its API on a free port."""

    def __init__(self, config: Path, join: list[Path], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(LAUNCHER),
                *(a for j in join for a in ("--join", str(j))),
                "--",
                "run",
                "--config",
                str(config),
                "--listen",
                f"127.0.0.1:{self.port}",
            ],
            cwd=REPO,
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
            return json.load(resp)

    def placement(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.tail()}")
        try:
            doc: dict[str, Any] = self.get("/placement")
            return doc
        except OSError:
            return None

    def events(self, kind: str) -> list[dict[str, Any]]:
        doc = self.get("/events?limit=1000")
        return [e for e in doc["events"] if e["kind"] == kind]

    def tail(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def poll(
    predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.02
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(interval_s)


def thread_cpus(pid: int) -> dict[int, str]:
    """Cpus_allowed_list of every thread of `pid` ({} once it is gone)."""
    out: dict[int, str] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(tid)] = line.split(":", 1)[1].strip()
    return out


def rank_pids(doc: dict[str, Any]) -> dict[int, int]:
    return {r["rank"]: r["pid"] for r in doc["ranks"] if r.get("pid")}


def all_on(doc: dict[str, Any], want: dict[int, str]) -> bool:
    """Every thread of every rank has exactly its wanted CPU list, and the plan says so."""
    pids = rank_pids(doc)
    for rank, cpus in want.items():
        entry = next(r for r in doc["ranks"] if r["rank"] == rank)
        if format_cpulist(entry["cpus"]) != cpus or rank not in pids:
            return False
        threads = thread_cpus(pids[rank])
        if not threads or set(threads.values()) != {cpus}:
            return False
    return True


def write_config(
    tmp_path: Path, *, ranks: int, threads: int, interval_s: float, worker: Path
) -> Path:
    doc = {
        "cpu_ranks": ranks,
        "cgroup": "auto",
        "stop_timeout_s": 5,
        "workers": {"command": ["python", str(worker), str(threads)]},
        "placement": {"rank_roles": {}, "engine": {"enabled": False}},
    }
    text = to_toml(doc) + f"[drift]\ncheck_interval_s = {interval_s}\n"
    text += '[threads.comm]\nprocess = "workers"\npattern = "comm*"\n'
    path = tmp_path / "cpuset.toml"
    path.write_text(text)
    return path


@contextlib.contextmanager
def confined_daemon(
    tmp_path: Path, name: str, *, ranks: int = 2, threads: int = 2, interval_s: float = 0.2
) -> Iterator[tuple[DaemonProcess, Path]]:
    """The daemon in a fresh v1 cpuset (0-1), its workers in per-rank cgroups below."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    config = write_config(
        tmp_path, ranks=ranks, threads=threads, interval_s=interval_s, worker=worker
    )
    suffix = f"{name}-{os.getpid()}"
    env = dict(os.environ, **{INSTANCE_ENV: suffix, "PYTHONUNBUFFERED": "1"})
    memory = own_memory_cgroup()
    with v1_cpuset(f"ps-{suffix}") as cg:
        daemon = DaemonProcess(config, [cg / "cgroup.procs"], env, tmp_path / "daemon.log")
        try:
            yield daemon, cg
        finally:
            daemon.stop()
            if memory is not None:
                remove_v1_tree(memory / f"placement-supervisor-{suffix}", memory)


# -- the test ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_v1_cpuset_shrink_and_grow_replan_and_rebind(tmp_path: Path) -> None:
    why = v1_available()
    if why is not None:
        pytest.skip(why)
    with confined_daemon(tmp_path, "cpuset") as (daemon, cg):
        doc = poll(
            lambda: (d := daemon.placement()) and len(rank_pids(d)) == 2 and d,
            30,
            "both ranks running",
        )
        assert [r["cpus"] for r in doc["ranks"]] == [[0], [1]], doc["ranks"]
        assert not doc["shared"]
        inst = cg / f"placement-supervisor-cpuset-{os.getpid()}"
        assert (inst / "rank0").is_dir(), "the daemon made no per-rank cgroups"
        poll(lambda: all_on(daemon.placement() or {}, {0: "0", 1: "1"}), 10, "start placement")
        pids = rank_pids(doc)

        write_v1_cpus(cg, {1})
        doc = poll(
            lambda: (d := daemon.placement()) and all_on(d, {0: "1", 1: "1"}) and d,
            10,
            "both ranks re-planned onto CPU 1",
        )
        assert doc["shared"] and doc["supervisor"]["cpuset_changes"] == 1
        assert (inst / "rank0" / "cpuset.cpus").read_text().strip() == "1"
        assert rank_pids(doc) == pids  # re-bound, not restarted

        write_v1_cpus(cg, {0, 1})
        doc = poll(
            lambda: (d := daemon.placement()) and all_on(d, {0: "0", 1: "1"}) and d,
            10,
            "ranks back on their own CPUs after the grow",
        )
        assert not doc["shared"] and doc["supervisor"]["cpuset_changes"] == 2
        assert (inst / "rank0" / "cpuset.cpus").read_text().strip() == "0"
        assert (inst / "cpuset.cpus").read_text().strip() == "0-1"
        assert rank_pids(doc) == pids
        cpuset_events = daemon.events("cpuset")
        assert [e["fields"]["new_cpus"] for e in cpuset_events] == [[1], [0, 1]]
        rebinds = [e for e in daemon.events("rebind") if e["fields"]["reason"] == "cpuset_changed"]
        assert rebinds, daemon.tail()
