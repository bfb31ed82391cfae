"""A rank's cgroup changed by another process while a real daemon runs (cgroup v1 here).

The daemon runs confined to a v1 cpuset made for the test, its ranks in
per-rank memory cgroups (v1 has no per-rank cpusets). The test plays someone
else (a cleanup script, an orchestrator): it moves a rank's worker out of its
cgroup and removes the dir, then checks that the daemon re-makes it and puts
the worker back (`enforce`), or reports it and leaves it (`observe`), and
that a worker respawned after the removal runs in the re-made dir.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import urllib.request
from pathlib import Path

import pytest

from tests.support.cgroup_v1 import own_memory_cgroup, v1_available
from tests.support.daemon_support import (
    DaemonProcess,
    confined_daemon,
    rank_pids,
)
from tests.support.poll import poll

pytestmark = pytest.mark.root


def drift_count(daemon: DaemonProcess, rank: str, kind: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    pattern = rf'^placement_drift_events_total\{{kind="{kind}",rank="{rank}"\}} (\S+)$'
    m = re.search(pattern, text, re.MULTILINE)
    return int(float(m.group(1))) if m else -1


def procs(cgroup: Path) -> list[int]:
    try:
        return [int(w) for w in (cgroup / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def remove_as_someone_else(rank_dir: Path, to: Path) -> None:
    """Move every process out of `rank_dir` (to `to`), then rmdir it."""
    for pid in procs(rank_dir):
        with contextlib.suppress(ProcessLookupError):
            (to / "cgroup.procs").write_text(str(pid))

    def removed() -> bool:
        try:
            rank_dir.rmdir()
        except OSError:
            return False  # busy until the kernel lets go: poll
        return True

    poll(removed, 10, what=f"rmdir {rank_dir}")


def started(daemon: DaemonProcess) -> dict[int, int]:
    doc = poll(
        lambda: (d := daemon.placement()) and len(rank_pids(d)) == 2 and d,
        30,
        what="both ranks running",
    )
    return rank_pids(doc)


def rank0(daemon: DaemonProcess) -> dict[str, object]:
    doc = daemon.placement() or {"ranks": []}
    return next((r for r in doc["ranks"] if r["rank"] == 0), {})


@pytest.fixture
def memory() -> Path:
    why = v1_available()
    mem = own_memory_cgroup()
    if why is not None or mem is None:
        pytest.skip(why or "no v1 memory cgroup")
    return mem


@pytest.mark.timeout(120)
def test_a_removed_rank_cgroup_is_remade_and_the_worker_put_back(
    tmp_path: Path, memory: Path
) -> None:
    with confined_daemon(tmp_path, "remake") as (daemon, _cg):
        pids = started(daemon)
        rank_dir = memory / f"placement-supervisor-remake-{os.getpid()}" / "rank0"
        poll(lambda: pids[0] in procs(rank_dir), 10, what="rank 0 in its cgroup")
        assert drift_count(daemon, "0", "cgroup") == 0

        remove_as_someone_else(rank_dir, memory)
        poll(lambda: pids[0] in procs(rank_dir), 10, what="rank 0's cgroup re-made, worker back")
        poll(lambda: drift_count(daemon, "0", "cgroup") == 1, 10, what="drift counted once")
        assert rank_pids(daemon.placement() or {"ranks": []}) == pids  # put back, not restarted
        drift = [e for e in daemon.events("drift") if e["rank"] == "0"]
        assert any("cgroup" in str(e) for e in drift), drift
        poll(lambda: not rank0(daemon)["drift"], 10, what="no cgroup drift left")
        assert drift_count(daemon, "1", "cgroup") == 0


@pytest.mark.timeout(120)
def test_a_removed_rank_cgroup_is_only_reported_under_observe(tmp_path: Path, memory: Path) -> None:
    with confined_daemon(tmp_path, "observe", policy={"cgroup": "observe"}) as (daemon, _cg):
        pids = started(daemon)
        rank_dir = memory / f"placement-supervisor-observe-{os.getpid()}" / "rank0"
        poll(lambda: pids[0] in procs(rank_dir), 10, what="rank 0 in its cgroup")
        remove_as_someone_else(rank_dir, memory)

        def reported() -> object:
            r = rank0(daemon)
            found = [f for f in r.get("drift", []) if f["kind"] == "cgroup"]  # type: ignore[attr-defined]
            return found and r["observed"]["cgroup"]["missing"] and found  # type: ignore[index]

        found = poll(reported, 10, what="/placement reports the removed cgroup")
        assert [(f["target"], f["action"]) for f in found] == [("cgroup", "observe")]
        poll(lambda: drift_count(daemon, "0", "cgroup") == 1, 10, what="drift counted")
        checks = (daemon.placement() or {})["supervisor"]["checks"]
        poll(
            lambda: (daemon.placement() or {})["supervisor"]["checks"] >= checks + 3,
            10,
            what="three more checks",
        )
        assert not rank_dir.exists()  # observe: left as found
        assert drift_count(daemon, "0", "cgroup") == 1  # counted once while it lasts


@pytest.mark.timeout(120)
def test_a_worker_respawned_after_its_cgroup_was_removed_runs_in_it(
    tmp_path: Path, memory: Path
) -> None:
    # Checks every 60 s: only the respawn path can re-make the dir in time.
    with confined_daemon(tmp_path, "respawn", interval_s=60.0, cpuset_watch_s=0) as (daemon, _cg):
        pids = started(daemon)
        rank_dir = memory / f"placement-supervisor-respawn-{os.getpid()}" / "rank0"
        poll(lambda: pids[0] in procs(rank_dir), 10, what="rank 0 in its cgroup")
        remove_as_someone_else(rank_dir, memory)
        os.kill(pids[0], signal.SIGKILL)
        doc = poll(
            lambda: (d := daemon.placement()) and rank_pids(d).get(0) not in (None, pids[0]) and d,
            30,
            what="rank 0 respawned",
        )
        new = rank_pids(doc)[0]
        assert new in procs(rank_dir), daemon.tail()
        r = rank0(daemon)
        assert r["cgroup"] == str(rank_dir), r
