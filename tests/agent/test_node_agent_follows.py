"""The node agent follows real runc containers as they change (issue 31).

One container in the kubelet's cgroupfs layout, a fake `vllm serve` whose two
workers carry LOCAL_RANK=0/1, started before the agent:

- `runc update --cpuset-cpus 1`, then `0-1` again: each time the agent starts
  the container's supervisor again within the new set and both workers' threads
  end up on the new plan, the engine untouched (the same worker pids). The way
  back to 0-1 is the telling one: the kernel widens every thread's affinity to
  the whole cpuset (cpuset(7)), and only a supervisor planned within 0-1 puts
  rank 0 on CPU 0 and rank 1 on CPU 1 again.
- the container killed, deleted and run again under the same id (a restart: a
  new main process and new workers): a new supervisor, the new workers placed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent_support import (
    Agent,
    agent_running,
    base_config,
    engine_bundle,
    placed,
    rank_cpus,
    worker_pids,
)
from tests.support.oci import host_pids, kubelet_parents, runc, running, state
from tests.support.poll import poll

pytestmark = pytest.mark.usefixtures("need_root")


def _entry(agent: Agent, cid: str) -> dict[str, Any] | None:
    docs = agent.containers()
    return next((d for d in docs or () if d["container_id"] == cid), None)


def _placed_on(agent: Agent, cid: str, cpus: str, **differs: object) -> dict[str, Any] | None:
    """The container's entry once its cgroup allows `cpus`, its share is `cpus`
    and both workers are placed, by a child other than differs["child_pid"]."""
    doc = _entry(agent, cid)
    if doc is None or doc["cpus"] != cpus or doc["share"] != cpus or not placed(doc):
        return None
    if "child_pid" in differs and doc["child_pid"] == differs["child_pid"]:
        return None
    return doc


@contextlib.contextmanager
def _one_container_placed(tmp_path: Path) -> Iterator[tuple[Agent, str, dict[str, Any]]]:
    """One fake vLLM container on 0-1 in the kubelet's layout, its two workers
    up, then the agent: (the agent, the container id, its entry once placed)."""
    pod = str(uuid.uuid4())
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    bundle = tmp_path / cid[:12]
    engine_bundle(bundle, tmp_path, f"/kubepods/besteffort/pod{pod}/{cid}", "0-1")
    with (
        kubelet_parents(pod),
        running(bundle, cid[:32], tmp_path / "runc.log"),
    ):
        poll(lambda: len(host_pids(cid[:32])) == 3, 30, what="engine and 2 workers")
        with agent_running(tmp_path, pods=[pod], base=base_config()) as agent:
            first = poll(lambda: _placed_on(agent, cid, "0-1"), 60, 0.5, what="placed on 0-1")
            assert rank_cpus(first) == {0: "0", 1: "1"}, first
            yield agent, cid, first


@pytest.mark.usefixtures("runc_on_two_cpus")
def test_the_agent_follows_a_runc_update_of_the_container_s_cpuset(tmp_path: Path) -> None:
    with _one_container_placed(tmp_path) as (agent, cid, first):
        workers = worker_pids(first)

        runc("update", "--cpuset-cpus", "1", cid[:32])
        narrowed = poll(
            lambda: _placed_on(agent, cid, "1", child_pid=first["child_pid"]),
            60,
            0.5,
            what="placed again within CPU 1",
        )
        assert rank_cpus(narrowed) == {0: "1", 1: "1"}, narrowed
        assert worker_pids(narrowed) == workers  # the engine was not touched

        runc("update", "--cpuset-cpus", "0-1", cid[:32])
        widened = poll(
            lambda: _placed_on(agent, cid, "0-1", child_pid=narrowed["child_pid"]),
            60,
            0.5,
            what="placed again on 0-1, one CPU per rank",
        )
        assert rank_cpus(widened) == {0: "0", 1: "1"}, widened
        assert worker_pids(widened) == workers
        log = agent.log.read_text()
        cgroup = first["cgroup"]
        restarts = f"child restart cgroup={cgroup} why='cpuset, share or main process changed'"
        assert log.count(restarts) == 2, log[-4000:]


@pytest.mark.usefixtures("runc_on_two_cpus")
def test_a_container_run_again_under_its_id_is_placed_again(tmp_path: Path) -> None:
    with _one_container_placed(tmp_path) as (agent, cid, first):
        bundle = tmp_path / cid[:12]
        old = set(worker_pids(first).values())

        # The restart lands between two of the agent's passes (it is stopped
        # meanwhile), as a restart quicker than its interval does: the next
        # pass sees the same cgroup with another main process.
        os.kill(agent.proc.pid, signal.SIGSTOP)
        try:
            runc("kill", cid[:32], "KILL", check=False)
            poll(lambda: state(cid[:32]) in ("stopped", "gone"), 20, what="stopped")
            runc("delete", "--force", cid[:32])
            with open(tmp_path / "runc-again.log", "wb") as out:
                again = subprocess.run(
                    ["runc", "run", "-d", "--bundle", str(bundle), cid[:32]],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    timeout=60,
                    check=False,
                )
            assert again.returncode == 0, (tmp_path / "runc-again.log").read_text()
            poll(lambda: len(host_pids(cid[:32])) == 3, 30, what="the new engine's workers")
        finally:
            os.kill(agent.proc.pid, signal.SIGCONT)

        def placed_again() -> dict[str, Any] | None:
            doc = _placed_on(agent, cid, "0-1", child_pid=first["child_pid"])
            return doc if doc and not set(worker_pids(doc).values()) & old else None

        second = poll(placed_again, 60, 0.5, what="the new workers placed by a new child")
        assert rank_cpus(second) == {0: "0", 1: "1"}, second
        assert not Path(f"/proc/{first['child_pid']}").exists()
        log = agent.log.read_text()
        cgroup = first["cgroup"]
        # Seen as a new main process (the usual case), or, when the agent was
        # stopped in the middle of a look at /proc, as gone and found again.
        assert (
            f"child restart cgroup={cgroup} why='cpuset, share or main process changed'" in log
            or f"container gone cgroup={cgroup}" in log
        ), log[-4000:]
