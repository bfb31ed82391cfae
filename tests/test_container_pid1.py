"""The daemon as PID 1 of a real runc container: it reaps what is re-parented to it,
stops the workers before the engine on `runc kill TERM`, and is gone within the
runtime's grace period (`stop_grace_s`) however long stop_timeout_s is.

The engine and the workers are one stand-in script: on TERM each appends a
line (CLOCK_MONOTONIC ns, role) to a shared file, then exits or, to use up the
daemon's waits, keeps running. A worker double-forks grandchildren that exit
as soon as they are re-parented: orphans that no tree pass can see alive,
which no proc connector reports inside a container's pid namespace. The test
reads the container's /proc (its pid namespace) from the host through
/proc/<init pid>/root/proc.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.support.daemon_support import (
    to_toml,
)
from tests.support.oci import Profile, host_pids, init_pid, runc, running, state
from tests.support.poll import poll
from tests.test_container import get, live, needs_runc, start

pytestmark = pytest.mark.root
ORPHANS = 3

# argv: role, the TERM log, "exit" or "ignore" (on TERM), orphans to make, their pid file.
STANDIN = r"""
import os, signal, sys, time

role, term_log, on_term_mode = sys.argv[1], sys.argv[2], sys.argv[3]
orphans, orphan_log = int(sys.argv[4]), sys.argv[5]

def append(path, line):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, line.encode())  # one write: lines from every process stay whole
    os.close(fd)

def on_term(signum, frame):
    append(term_log, f"{time.monotonic_ns()} {role}\n")
    if on_term_mode == "exit":
        os._exit(0)

signal.signal(signal.SIGTERM, on_term)
append(term_log + ".up", f"{role}\n")  # the handler is in place
for _ in range(orphans):
    middle = os.fork()
    if middle == 0:
        parent = os.getpid()
        if os.fork() == 0:
            # The grandchild: gone as soon as its parent (the middle) is and it is
            # re-parented, long before any tree pass could see it.
            while os.getppid() == parent:
                time.sleep(0.001)
            append(orphan_log, f"{os.getpid()}\n")
            os._exit(0)
        os._exit(0)
    os.waitpid(middle, 0)
while True:
    time.sleep(3600)
"""


def write_standin(tmp_path: Path) -> Path:
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    return script


def write_config(
    tmp_path: Path, *, on_term: str, orphans: int, stop_timeout_s: float, grace_s: float | None
) -> Path:
    script = write_standin(tmp_path)
    term_log, orphan_log = tmp_path / "term.log", tmp_path / "orphans.log"

    def command(role: str, n: int) -> list[str]:
        return ["python", str(script), role, str(term_log), on_term, str(n), str(orphan_log)]

    doc: dict[str, object] = {
        "cpu_ranks": 2,
        "cgroup": "auto",
        "stop_timeout_s": stop_timeout_s,
        "engine": {"command": command("engine", 0)},
        "workers": {"command": command("worker{rank}", orphans)},
        "placement": {"rank_roles": {}},
    }
    if grace_s is not None:
        doc["stop_grace_s"] = grace_s
    path = tmp_path / "pid1.toml"
    path.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 1.0\n")
    return path


def container_zombies(init: int) -> list[str]:
    """The zombies of the container's pid namespace, as "pid ppid comm" (its own numbers)."""
    out = []
    proc = Path(f"/proc/{init}/root/proc")
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields[0] == "Z":
            out.append(f"{entry.name} ppid={fields[1]} {stat[: stat.rfind(')') + 1]}")
    return out


def term_order(tmp_path: Path) -> list[tuple[int, str]]:
    path = tmp_path / "term.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return sorted((int(ns), role) for ns, role in (ln.split() for ln in lines))


def ready(port: int, log: Path, tmp_path: Path) -> None:
    """The daemon ready, and every stand-in's TERM handler in place."""
    poll(
        lambda: (d := get(port, "/readyz")) is not None and d.get("status") == 200,
        60,
        what=f"ready in the container: {get(port, '/readyz')}\n{log.read_text()[-3000:]}",
    )
    up = tmp_path / "term.log.up"
    poll(lambda: up.exists() and len(up.read_text().split()) == 3, 30, what="stand-ins up")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("privileged", [False, True], ids=["unprivileged", "privileged"])
def test_pid1_reaps_orphans_and_stops_workers_before_the_engine(
    tmp_path: Path, privileged: bool
) -> None:
    needs_runc()
    config = write_config(tmp_path, on_term="exit", orphans=ORPHANS, stop_timeout_s=5, grace_s=None)
    bundle, cid, port, log = start(tmp_path, Profile(privileged=privileged), config)
    with running(bundle, cid, log):
        ready(port, log, tmp_path)
        init = init_pid(cid)
        assert init is not None
        orphans = tmp_path / "orphans.log"
        poll(
            lambda: orphans.exists() and len(orphans.read_text().split()) == 2 * ORPHANS,
            30,
            what="every worker's orphans made",
        )
        # Before: each orphan a zombie of PID 1 until the container stopped.
        poll(
            lambda: not container_zombies(init),
            10,
            what=f"the orphans reaped by PID 1: {container_zombies(init)}",
        )
        # cn_proc would number the events as the host does: the daemon does not listen.
        text = log.read_text()
        assert 'process events source="checks only"' in text, text[-3000:]
        assert "child pid namespace" in text, text[-3000:]
        names = {
            p: Path(f"/proc/{init}/root/proc/{p}").exists() for p in orphans.read_text().split()
        }
        assert not any(names.values()), names
        pids = host_pids(cid)
        t0 = time.monotonic()
        assert runc("kill", cid, "TERM", check=False).returncode == 0
        poll(lambda: state(cid) == "stopped", 15, 0.05, what="stopped within 15 s of TERM")
        print(f"\nstopped {time.monotonic() - t0:.2f}s after runc kill TERM")
        poll(lambda: not live(pids), 5, what=f"no process of the container left: {live(pids)}")
        order = [role for _, role in term_order(tmp_path)]
        assert sorted(order) == ["engine", "worker0", "worker1"], order
        assert order[-1] == "engine", f"the workers get TERM before the engine: {order}"
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.mark.timeout(300)
def test_pid1_stop_fits_the_runtime_grace_with_a_long_stop_timeout(tmp_path: Path) -> None:
    needs_runc()
    grace_s, stop_timeout_s = 10.0, 8.0  # uncapped: 8 s for the workers, 8 more for the engine
    config = write_config(
        tmp_path, on_term="ignore", orphans=0, stop_timeout_s=stop_timeout_s, grace_s=grace_s
    )
    bundle, cid, port, log = start(tmp_path, Profile(privileged=False), config)
    with running(bundle, cid, log):
        ready(port, log, tmp_path)
        text = log.read_text()
        assert "stop budget" in text and "stop_grace_s=10" in text, text[-3000:]
        pids = host_pids(cid)
        assert len(pids) >= 4, pids  # the daemon, the engine, two workers (and the guardian)
        t0 = time.monotonic()
        assert runc("kill", cid, "TERM", check=False).returncode == 0
        poll(lambda: state(cid) == "stopped", 30, 0.05, what="stopped after TERM")
        stop_s = time.monotonic() - t0
        order = term_order(tmp_path)
        print(
            f"\nstop_timeout_s={stop_timeout_s:g} stop_grace_s={grace_s:g}, every process "
            f"ignoring TERM: stopped {stop_s:.2f}s after runc kill TERM; TERM order "
            + ", ".join(f"{role}+{(ns - order[0][0]) / 1e9:.2f}s" for ns, role in order)
        )
        # The runtime KILLs at the grace: a stop past it is an unclean one.
        assert stop_s < grace_s, f"stopped {stop_s:.2f}s after TERM, grace {grace_s:g}s"
        assert not live(pids), live(pids)
        roles = [role for _, role in order]
        assert sorted(roles) == ["engine", "worker0", "worker1"] and roles[-1] == "engine", roles
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        assert "stopped" in text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
