"""The start-up hook in a process the daemon adopted into a rank's cgroup: its pools
follow that rank's slot (PLACEMENT_SUPERVISOR_RANK_SLOTS), not the engine's it
inherited. SGLang builds a grammar pool in each scheduler after it is adopted.

Real interpreters in a real v1 cpuset named `rank1`, as the daemon names a
rank's cgroup; the engine's slot has so_compiler = CPU 1, rank 1's slot has
so_compiler = CPUs 0-1, so the cap (1 or 2) and the binding tell them apart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from supervisor.config import discovery_options, parse_config
from supervisor.hostfs import HostFS
from supervisor.plan.placement import Placement
from supervisor.plan.planner import plan
from supervisor.run.spec import RANK_SLOTS_ENV, build_specs
from supervisor.topology.discover import read_topology
from supervisor.worker import slot_env_value
from tests.hook.test_hook import POOL_PROGRAM, child_env, run_python

RANK_SLOT = {"cpus": [0, 1], "mems": [0], "roles": {"main": [0, 1], "so_compiler": [0, 1]}}
RANK_SLOTS = json.dumps({"1": json.loads(slot_env_value(1, RANK_SLOT))})


def test_a_pool_made_in_rank_1_s_cgroup_is_capped_and_bound_by_rank_1_s_slot() -> None:
    if os.geteuid() != 0 or not Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists():
        pytest.fail("needs root and the cgroup v1 cpuset hierarchy (as the other cgroup tests)")
    from tests.support.cgroup_v1 import v1_cpuset  # noqa: PLC0415

    with v1_cpuset(f"ps-rank-slots-{os.getpid()}", cpus="0-1") as parent:
        cg = parent / "rank1"
        cg.mkdir()
        try:
            (cg / "cpuset.mems").write_text("0")
            (cg / "cpuset.cpus").write_text("0-1")
            join = (
                f"open({str(cg / 'cgroup.procs')!r}, 'w').write(str(__import__('os').getpid()))\n"
            )
            in_rank = run_python(join + POOL_PROGRAM, child_env(**{RANK_SLOTS_ENV: RANK_SLOTS}))
            # The same process outside a rank's cgroup keeps the engine's slot.
            engine = run_python(POOL_PROGRAM, child_env(**{RANK_SLOTS_ENV: RANK_SLOTS}))
        finally:
            cg.rmdir()
    assert in_rank.returncode == 0, in_rank.stderr
    max_workers, threads, _ = json.loads(in_rank.stdout.splitlines()[-1])["listed"]
    assert max_workers == 2
    assert {tuple(t["cpus"]) for t in threads} == {(0, 1)}
    assert engine.returncode == 0, engine.stderr
    max_workers, threads, _ = json.loads(engine.stdout.splitlines()[-1])["listed"]
    assert max_workers == 1
    assert {tuple(t["cpus"]) for t in threads} == {(1,)}


def test_an_engine_whose_workers_are_adopted_carries_every_rank_s_slot() -> None:
    doc = {
        "cpu_ranks": 2,
        "engine": {"command": ["python", "-m", "sglang.launch_server", "--tp", "2"]},
        "workers": {"spawned_by": "engine"},
        "placement": {"on_shortage": "share", "rank_roles": {}},
        "threads": {"so_compiler": {"process": "engine", "executors": ["sglang.srt.constrained"]}},
    }
    cfg = parse_config(doc)
    topology = read_topology(HostFS("/"), discovery_options(cfg, {}))
    placement: Placement = plan(topology, cfg.placement)
    assert len(placement.ranks) == 2
    engine = build_specs(cfg, placement, {})[0]
    slots = json.loads(engine.env[RANK_SLOTS_ENV])
    assert sorted(slots) == [str(r.rank) for r in placement.ranks]
    assert slots["1"]["cpus"] == list(placement.ranks[1].slot.cpus)
