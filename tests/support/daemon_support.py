"""The daemon from the outside, for tests and benches: waiting, ports, configs, processes.

Does I/O: starts `python -m supervisor` as a subprocess (`DaemonProcess`,
`run_supervisor`, `confined_daemon`), talks to its HTTP API on 127.0.0.1,
and stops what it started. Also the TOML writer for test configs and the
deadline-bounded waits every test uses instead of sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor.cpulist import format_cpulist
from supervisor.toml_out import to_toml  # re-exported: the tests' configs
from tests.support.cgroup_v1 import own_memory_cgroup, remove_v1_tree, v1_cpuset
from tests.support.children import COMM_THREADS_WORKER, thread_cpus
from tests.support.poll import poll

REPO = Path(__file__).resolve().parents[2]
# Joins the given cgroups, then execs `python -m supervisor` (same pid).
LAUNCHER = REPO / "tests/vm_checks/checker_daemon.py"
INSTANCE_ENV = "PLACEMENT_SUPERVISOR_INSTANCE"

# -- ports, HTTP, processes -------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listened on a moment ago (closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def stop_process(
    proc: subprocess.Popen[Any], timeout_s: float = 20.0, *, group: bool = False
) -> int:
    """SIGTERM; SIGKILL (its whole process group with `group`) if still there
    after `timeout_s`; reaped. Returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def daemon_env(**extra: str) -> dict[str, str]:
    """This environment without systemd's variables, with a cgroup instance of our own."""
    env = dict(os.environ)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
        env.pop(name, None)
    # Our own cgroup instance dir, apart from any other supervisor on this host.
    env[INSTANCE_ENV] = f"test-{os.getpid()}"
    env.update(extra)
    return env


def run_supervisor(
    *args: str, env: Mapping[str, str] | None = None, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """`python -m supervisor ARGS` run to its end, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


# -- the daemon as a subprocess ---------------------------------------------------------------


def entries(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine (if any) and every rank of a GET /placement document."""
    out = [doc["engine"]] if doc.get("engine") else []
    return out + list(doc["ranks"])


def rank_pids(doc: dict[str, Any]) -> dict[int, int]:
    return {r["rank"]: r["pid"] for r in doc["ranks"] if r.get("pid")}


class DaemonProcess:
    """`python -m supervisor run --config CONFIG --listen 127.0.0.1:PORT` as a subprocess.

    Its stderr goes to `log` (stdout, which its children share, is dropped).
    With `join`, it starts through tests/vm_checks/checker_daemon.py, which
    writes its pid into each of those cgroup.procs files before the exec, so
    the daemon starts confined. With `new_session`, it leads a session and
    process group of its own. Stopped (SIGTERM, then SIGKILL) on `stop()`
    or at the end of a `with` block.
    """

    def __init__(
        self,
        config: Path | str,
        log: Path | str,
        *,
        env: Mapping[str, str] | None = None,
        join: Sequence[Path | str] = (),
        port: int | None = None,
        prefix: Sequence[str] = (),
        new_session: bool = False,
        args: Sequence[str] = (),
    ) -> None:
        self.port = free_port() if port is None else port
        self.log = Path(log)
        self._log_file = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        joined = [a for j in join for a in ("--join", str(j))]
        start = [str(LAUNCHER), *joined, "--"] if join else ["-m", "supervisor"]
        listen = f"127.0.0.1:{self.port}"
        # `args`: more of run's options (--log-level).
        argv = ["run", "--config", str(config), "--listen", listen, *args]
        self.proc = subprocess.Popen(
            # `prefix`: a command that execs the rest (setpriv), same pid.
            [*prefix, sys.executable, *start, *argv],
            cwd=REPO,
            env=dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"),
            stdout=subprocess.DEVNULL,
            stderr=self._log_file,
            # Its own session and process group (pgid == pid), as under systemd or
            # a login shell: a signal to its group then reaches no test runner.
            start_new_session=new_session,
        )
        self.pid = self.proc.pid

    def get(self, path: str) -> Any:
        """The API's JSON answer for `path`, or None while it does not answer."""
        try:
            return get_json(f"http://127.0.0.1:{self.port}{path}")
        except OSError:
            return None

    def placement(self) -> dict[str, Any] | None:
        """GET /placement (None while it does not answer); fails once the daemon exited."""
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.tail()}")
        doc: dict[str, Any] | None = self.get("/placement")
        return doc

    def running(self) -> dict[str, Any] | None:
        """GET /placement once every process runs with a pid, else None."""
        doc = self.placement()
        if doc and all(e["state"] == "running" and e["pid"] for e in entries(doc)):
            return doc
        return None

    def checks(self) -> int:
        """Check passes finished so far (/placement's supervisor.checks)."""
        doc = self.placement()
        return int(doc["supervisor"]["checks"]) if doc else 0

    def after_checks(self, n: int, timeout_s: float = 20.0) -> None:
        """Wait for `n` more check passes to finish: the window a test gives the
        daemon to (not) act is counted in passes, not guessed in seconds."""
        start = self.checks()
        poll(lambda: self.checks() >= start + n, timeout_s, what=f"{n} more check passes")

    def events(self, kind: str) -> list[dict[str, Any]]:
        doc = self.get("/events?limit=1000") or {"events": []}
        return [e for e in doc["events"] if e["kind"] == kind]

    def tail(self, chars: int = 4000) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (SIGKILL after `timeout_s`); returns the exit status."""
        code = stop_process(self.proc, timeout_s)
        self._log_file.close()
        return code

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def thread_cpus_as_planned(doc: dict[str, Any], want: dict[int, str]) -> bool:
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


def write_cpuset_config(
    tmp_path: Path,
    *,
    ranks: int,
    threads: int,
    interval_s: float,
    worker: Path,
    cpuset_watch_s: float | None = None,
    policy: dict[str, str] | None = None,
) -> Path:
    """Ranks of COMM_THREADS_WORKER in per-rank cgroups, checked every `interval_s`
    (the allowed set every `cpuset_watch_s` when given; 0: only at the checks),
    with `policy` as [drift.policy]."""
    doc = {
        "cpu_ranks": ranks,
        "cgroup": "auto",
        "stop_timeout_s": 5,
        "workers": {"command": ["python", str(worker), str(threads)]},
        "placement": {"rank_roles": {}, "engine": {"enabled": False}},
    }
    text = to_toml(doc) + f"[drift]\ncheck_interval_s = {interval_s}\n"
    if cpuset_watch_s is not None:
        text += f"cpuset_watch_s = {cpuset_watch_s}\n"
    if policy:
        text += "[drift.policy]\n" + "".join(f'{k} = "{v}"\n' for k, v in policy.items())
    text += '[threads.comm]\nprocess = "workers"\npattern = "comm*"\n'
    path = tmp_path / "cpuset.toml"
    path.write_text(text)
    return path


@contextlib.contextmanager
def confined_daemon(
    tmp_path: Path,
    name: str,
    *,
    ranks: int = 2,
    threads: int = 2,
    interval_s: float = 0.2,
    cpuset_watch_s: float | None = None,
    policy: dict[str, str] | None = None,
) -> Iterator[tuple[DaemonProcess, Path]]:
    """The daemon in a fresh v1 cpuset (0-1), its workers in per-rank cgroups below;
    every process stopped and every cgroup removed afterwards."""
    worker = tmp_path / "worker.py"
    worker.write_text(COMM_THREADS_WORKER)
    config = write_cpuset_config(
        tmp_path,
        ranks=ranks,
        threads=threads,
        interval_s=interval_s,
        worker=worker,
        cpuset_watch_s=cpuset_watch_s,
        policy=policy,
    )
    suffix = f"{name}-{os.getpid()}"
    env = dict(os.environ, **{INSTANCE_ENV: suffix})
    memory = own_memory_cgroup()
    with v1_cpuset(f"ps-{suffix}") as cg:
        daemon = DaemonProcess(config, tmp_path / "daemon.log", env=env, join=[cg / "cgroup.procs"])
        try:
            yield daemon, cg
        finally:
            daemon.stop()
            if memory is not None:
                remove_v1_tree(memory / f"placement-supervisor-{suffix}", memory)


# -- configs ------------------------------------------------------------------------------


# The demo worker as a config's workers.command (append its options).
DEMO_WORKER = ["python", "-m", "supervisor.demo.worker", "--rank", "{rank}"]


def merge_config(doc: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`doc` with `extra` on top: a table merges into the table of that name,
    anything else replaces. Changes and returns `doc`."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return doc


def child_config(
    script: Path,
    out: Path,
    *,
    mode: str = "sleep",
    engine: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """A config document whose workers (and engine) are the reporting child."""
    doc: dict[str, Any] = {
        "cpu_ranks": 2,
        "cgroup": "off",
        "stop_timeout_s": 3,
        "workers": {"command": ["python", str(script), str(out), "{rank}", mode]},
        "restart": {
            "backoff_initial_s": 0.2,
            "backoff_max_s": 1.0,
            "crash_loop_limit": 3,
            "crash_loop_window_s": 60.0,
            "stable_after_s": 30.0,
        },
        "placement": {"rank_roles": {}},
    }
    if engine:
        doc["engine"] = {"command": ["python", str(script), str(out), "engine", "ready-file"]}
        doc["ready"] = {"file": str(out / "engine.ready"), "timeout_s": 20}
    else:
        doc["placement"]["engine"] = {"enabled": False}
    return merge_config(doc, extra)
