"""Keys a reload changes live take effect: the check loop, the tree keeper and the
API read the config in force (the plan holder's) when they use it, never a copy
made at start (issue 28 item 3). Real daemons, real SIGHUPs, real processes.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from supervisor.cpulist import format_cpulist
from tests.support.children import COMM_THREADS_WORKER
from tests.support.daemon_support import (
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

WORKER = r"""
import os, subprocess, sys, time
trigger, marker = sys.argv[1:3]
while not os.path.exists(trigger):
    time.sleep(0.02)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", marker])
time.sleep(3600)
"""


def _doc(worker: Path, trigger: Path, marker: str, drift: dict[str, float]) -> dict[str, Any]:
    return {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 2,
        "workers": {"command": ["python", str(worker), str(trigger), marker]},
        "placement": {"rank_roles": {}, "on_shortage": "share", "engine": {"enabled": False}},
        "drift": drift,
    }


def _reloaded(d: DaemonProcess, count: int) -> bool:
    doc = d.placement() or {}
    return doc.get("supervisor", {}).get("config_reloads", {}).get("ok", 0) >= count


def test_check_interval_and_what_derives_from_it_change_by_sighup(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    trigger = tmp_path / "spawn-now"
    marker = f"live-{uuid.uuid4().hex}"
    config = tmp_path / "live.toml"
    slow = {"check_interval_s": 5.0, "numa_maps_interval_s": 10.0}
    config.write_text(to_toml(_doc(worker, trigger, marker, slow)))
    # Checks only (no proc connector): a new process is seen at a tree pass, whose
    # interval is the check interval in force.
    env = daemon_env(PLACEMENT_SUPERVISOR_PROC_EVENTS="0")
    with DaemonProcess(config, tmp_path / "d.log", env=env) as d:
        poll(d.running, timeout_s=60, what="the worker running")
        assert d.get("/healthz")["stale_after_s"] == 30.0  # max(30, 5 x 5, 2 x 10)
        fast = {"check_interval_s": 0.2, "numa_maps_interval_s": 40.0}
        config.write_text(to_toml(_doc(worker, trigger, marker, fast)))
        os.kill(d.pid, signal.SIGHUP)
        poll(lambda: _reloaded(d, 1), timeout_s=30, what="the reload counted ok")
        # The check loop: more than 10 passes in the next 6 s (at 5 s: 1 or 2).
        before = d.get("/healthz")["checks"]
        time.sleep(6.0)  # a measuring window, not a wait for an event
        passes = d.get("/healthz")["checks"] - before
        assert passes > 10, f"{passes} passes in 6 s after the reload:\n{d.tail()}"
        # The API's staleness threshold: max(30, 5 x 0.2, 2 x 40).
        assert d.get("/healthz")["stale_after_s"] == 80.0
        # The tree keeper: a process the worker starts now is listed within a few
        # passes of 0.2 s, not at the next of 5 s.
        trigger.touch()
        started = time.monotonic()

        def listed() -> bool:
            rank = (d.placement() or {"ranks": [{}]})["ranks"][0]
            return any(marker in c.get("cmdline", "") for c in rank.get("children", []))

        poll(listed, timeout_s=30, what="the worker's new child listed")
        seen_s = time.monotonic() - started
        assert seen_s < 2.0, f"the new child was listed after {seen_s:.1f} s:\n{d.tail()}"
        code = d.stop(timeout_s=30)
    assert code == 0, d.log.read_text(errors="replace")[-4000:]


def _post(port: int, path: str, token: str) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method="POST",
        data=b"",
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            status: int = resp.status
            return status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_token_is_rotated_by_rewriting_its_file_and_sighup(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first-token\n")
    token_file.chmod(0o600)
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 2,
        "workers": {"command": ["python", "-c", "import time; time.sleep(3600)", "{rank}"]},
        "placement": {"rank_roles": {}, "on_shortage": "share", "engine": {"enabled": False}},
        "api": {"token_file": str(token_file)},
    }
    config = tmp_path / "token.toml"
    config.write_text(to_toml(doc))
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as d:
        poll(d.running, timeout_s=60, what="the worker running")
        assert _post(d.port, "/rebind", "first-token") == 200
        assert _post(d.port, "/rebind", "second-token") == 401
        token_file.write_text("second-token\n")  # the rotation: the file, then a reload
        os.kill(d.pid, signal.SIGHUP)
        poll(lambda: _reloaded(d, 1), timeout_s=30, what="the reload counted ok")
        assert _post(d.port, "/rebind", "second-token") == 200, d.tail()
        assert _post(d.port, "/rebind", "first-token") == 401  # the leaked one is dead
        # A token file that cannot be used (open to others) is an invalid reload:
        # the token in force stays.
        token_file.write_text("third-token\n")
        token_file.chmod(0o644)
        os.kill(d.pid, signal.SIGHUP)
        poll(
            lambda: (
                (d.placement() or {})
                .get("supervisor", {})
                .get("config_reloads", {})
                .get("invalid", 0)
                >= 1
            ),
            timeout_s=30,
            what="the reload counted invalid",
        )
        assert _post(d.port, "/rebind", "second-token") == 200
        assert _post(d.port, "/rebind", "third-token") == 401
        code = d.stop(timeout_s=30)
    assert code == 0, d.log.read_text(errors="replace")[-4000:]


def test_stop_timeout_and_restart_settings_change_by_sighup(tmp_path: Path) -> None:
    # A worker that ignores TERM: the stop waits stop_timeout_s, then KILLs.
    stubborn = ["python", "-c", "import signal, time; signal.signal(15, 1); time.sleep(3600)"]
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 60,
        "workers": {"command": [*stubborn, "{rank}"]},
        "placement": {"rank_roles": {}, "on_shortage": "share", "engine": {"enabled": False}},
        "restart": {"backoff_initial_s": 30.0, "backoff_max_s": 60.0},
    }
    config = tmp_path / "stop.toml"
    config.write_text(to_toml(doc))
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as d:
        first = poll(d.running, timeout_s=60, what="the worker running")["ranks"][0]["pid"]
        doc["stop_timeout_s"] = 1
        doc["restart"] = {"backoff_initial_s": 0.2, "backoff_max_s": 1.0}
        config.write_text(to_toml(doc))
        os.kill(d.pid, signal.SIGHUP)
        poll(lambda: _reloaded(d, 1), timeout_s=30, what="the reload counted ok")
        # [restart]: a crash is restarted after the new backoff (0.2 s), not 30 s.
        os.kill(first, signal.SIGKILL)
        crashed = time.monotonic()

        def respawned() -> bool:
            rank = (d.running() or {"ranks": [{}]})["ranks"][0]
            return rank.get("pid") not in (None, first)

        poll(respawned, timeout_s=60, what="the worker restarted")
        assert time.monotonic() - crashed < 10, d.tail()
        # stop_timeout_s: the stop KILLs the TERM-proof worker after 1 s, not 60 s.
        started = time.monotonic()
        code = d.stop(timeout_s=120)
        took = time.monotonic() - started
    assert code == 0, d.log.read_text(errors="replace")[-4000:]
    assert took < 15, f"the stop took {took:.1f} s"


def _cpus_allowed(pid: int | str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for pid {pid}")


def test_the_drift_policy_changes_by_sighup(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to drift from")
    # The worker narrows its own affinity to one CPU: drift from its slot.
    narrow = (
        "import os, time; os.sched_setaffinity(0, [min(os.sched_getaffinity(0))]); time.sleep(3600)"
    )
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 2,
        "workers": {"command": ["python", "-c", narrow, "{rank}"]},
        "placement": {"rank_roles": {}, "on_shortage": "share", "engine": {"enabled": False}},
        "drift": {
            "check_interval_s": 0.2,
            "enforce_pinned": True,  # a thread narrowed inside its slot is drift too
            "policy": {"thread_affinity": "observe"},
        },
    }
    config = tmp_path / "policy.toml"
    config.write_text(to_toml(doc))
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as d:
        placed = poll(d.running, timeout_s=60, what="the worker running")["ranks"][0]
        pid, planned = placed["pid"], format_cpulist(placed["cpus"])
        poll(lambda: _cpus_allowed(pid) != planned, timeout_s=30, what="the worker narrowed")
        narrowed = _cpus_allowed(pid)
        # observe: left as it is, over several checks.
        d.after_checks(5)  # observe: five checks leave it
        assert _cpus_allowed(pid) == narrowed
        doc["drift"]["policy"]["thread_affinity"] = "enforce"
        config.write_text(to_toml(doc))
        os.kill(d.pid, signal.SIGHUP)
        poll(lambda: _reloaded(d, 1), timeout_s=30, what="the reload counted ok")
        poll(lambda: _cpus_allowed(pid) == planned, timeout_s=10, what="re-bound under enforce")
        code = d.stop(timeout_s=30)
    assert code == 0, d.log.read_text(errors="replace")[-4000:]


def _thread_cpus(pid: int, prefix: str) -> set[str]:
    """Cpus_allowed_list of each of `pid`'s threads whose name starts with `prefix`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        if Path(f"/proc/{pid}/task/{tid}/comm").read_text().startswith(prefix):
            out.add(_cpus_allowed(f"{pid}/task/{tid}"))
    return out


def test_thread_roles_change_by_sighup_in_place(tmp_path: Path) -> None:
    """A `[threads]` pattern changed by SIGHUP re-binds the matching threads of the
    running worker to their new role's CPUs: the same pid, no restart."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs: one for main, one for comm")
    worker = tmp_path / "worker.py"
    worker.write_text(COMM_THREADS_WORKER)
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 2,
        "workers": {"command": ["python", str(worker), "2"]},
        "placement": {
            "rank_roles": {"comm": 1},
            "on_shortage": "share",
            "engine": {"enabled": False},
        },
        "drift": {"check_interval_s": 0.2},
        "threads": {"comm": {"process": "workers", "pattern": "nothing-is-called-this*"}},
    }
    config = tmp_path / "roles.toml"
    config.write_text(to_toml(doc))
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as d:
        rank = poll(d.running, timeout_s=60, what="the worker running")["ranks"][0]
        pid, roles = rank["pid"], rank["roles"]
        main, comm = format_cpulist(roles["main"]), format_cpulist(roles["comm"])
        assert main != comm, roles
        # No thread matches comm: both comm-* threads are main's.
        poll(lambda: _thread_cpus(pid, "comm-") == {main}, 30, what="comm-* threads on main")
        d.after_checks(3)
        assert _thread_cpus(pid, "comm-") == {main}
        doc["threads"]["comm"]["pattern"] = "comm-*"
        config.write_text(to_toml(doc))
        os.kill(d.pid, signal.SIGHUP)
        poll(lambda: _reloaded(d, 1), timeout_s=30, what="the reload counted ok")
        poll(lambda: _thread_cpus(pid, "comm-") == {comm}, 10, what="comm-* re-bound to comm")
        assert _thread_cpus(pid, "python") == {main}  # the main thread stays
        assert (d.placement() or {})["ranks"][0]["pid"] == pid  # in place: no restart
        code = d.stop(timeout_s=30)
    assert code == 0, d.log.read_text(errors="replace")[-4000:]


def test_the_readiness_probe_changes_by_sighup(tmp_path: Path) -> None:
    """`[ready]` changed by SIGHUP is the probe of the engine's next start: after a
    crash the engine waits for the new file, not the old one that is still there."""
    first, second = tmp_path / "ready-1", tmp_path / "ready-2"
    first.touch()
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 2,
        "engine": {"command": ["python", "-c", "import time; time.sleep(3600)"]},
        "workers": {"command": ["python", "-c", "import time; time.sleep(3600)", "{rank}"]},
        "ready": {"file": str(first), "timeout_s": 600.0},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
        "placement": {"on_shortage": "share"},
        "drift": {"check_interval_s": 0.2},
    }
    config = tmp_path / "ready.toml"
    config.write_text(to_toml(doc))
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as d:
        engine = poll(d.running, timeout_s=60, what="engine and worker running")["engine"]["pid"]
        doc["ready"]["file"] = str(second)
        config.write_text(to_toml(doc))
        os.kill(d.pid, signal.SIGHUP)
        poll(lambda: _reloaded(d, 1), timeout_s=30, what="the reload counted ok")
        os.kill(engine, signal.SIGKILL)

        def loading() -> dict[str, Any] | None:
            entry = (d.placement() or {}).get("engine") or {}
            if entry.get("pid") in (None, engine):
                return None
            found: dict[str, Any] | None = entry.get("loading")
            return found

        probe = poll(loading, timeout_s=30, what="the restarted engine waiting for its probe")
        assert str(second) in probe["probe"], probe
        d.after_checks(5)
        assert (d.placement() or {})["engine"]["loading"] is not None, "ready on the old file"
        second.touch()
        poll(d.running, timeout_s=30, what="ready once the new file exists")
        code = d.stop(timeout_s=30)
    assert code == 0, d.log.read_text(errors="replace")[-4000:]
