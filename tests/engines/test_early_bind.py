"""Engine-spawned workers bound before their own code runs (the start-up hook's early rules).

`supervisor.engines.early` writes which rule names a rank before the worker
runs; the hook (`placement_supervisor_early.py`) applies it in real
interpreters. The tree is real: this test process stands for the supervisor,
a launcher child for the engine, and its children (plain, or multiprocessing
spawn and fork children with vLLM's and SGLang's targets) for the workers.
Each worker reports its CPUs and memory policy from its first instruction.
This box has one node and CPUs 0-1: rank 0 is planned on CPU 0, rank 1 on
CPU 1, both on node 0; an unbound child shows CPUs 0-1 and policy "default".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import parse_config
from supervisor.engines.early import EARLY_ENV
from supervisor.hook import HOOK_DIR, HOOK_ENV
from supervisor.plan.placement import DeviceRef, Placement, RankPlacement, Slot
from supervisor.run.spec import RANK_SLOTS_ENV, build_specs, rank_slots_value

REPO = Path(__file__).resolve().parents[2]


def placement() -> Placement:
    ranks = tuple(
        RankPlacement(
            r, DeviceRef("cpu", r, None, 0), Slot((r,), (0,), {"main": (r,)}), local_rank=r
        )
        for r in (0, 1)
    )
    return Placement("numa-affine", Slot((0, 1), (0,), {"main": (0, 1)}), ranks)


def engine_env(config_doc: dict[str, Any]) -> dict[str, str]:
    config = parse_config(config_doc)
    base = {k: v for k, v in os.environ.items() if not k.startswith("PLACEMENT_SUPERVISOR")}
    base["PYTHONPATH"] = str(REPO)
    specs = build_specs(config, placement(), base, supervisor_pid=os.getpid())
    engine = specs[0]
    assert engine.key == "engine"
    return dict(engine.env)


TORCHRUN = {
    "engine": {"command": ["python", "launcher.py"], "kind": "torchrun"},
    "workers": {"spawned_by": "engine"},
}


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (TORCHRUN, "local=0:0,1:1;env=LOCAL_RANK"),
        (
            {
                "engine": {"command": ["vllm", "serve", "m", "-tp", "2"]},
                "workers": {"spawned_by": "engine"},
            },
            "local=0:0,1:1;call=WorkerProc.worker_main:local_rank:-1",
        ),
        (
            {
                "engine": {"command": ["python", "-m", "sglang.launch_server", "--tp", "2"]},
                "workers": {"spawned_by": "engine"},
            },
            "local=0:0,1:1;call=run_scheduler_process:gpu_id:2",
        ),
        (
            {
                "engine": {"command": ["engine"]},
                "workers": {"spawned_by": "engine", "rank_from": ["env:MY_RANK", "device"]},
            },
            "local=0:0,1:1;env=MY_RANK",
        ),
        # vLLM with data parallelism shifts local_rank inside the worker: the title decides.
        (
            {
                "engine": {"command": ["vllm", "serve", "m", "-tp", "2", "-dp", "2"]},
                "workers": {"spawned_by": "engine"},
            },
            None,
        ),
        (
            {
                "engine": {"command": ["engine"]},
                "workers": {"spawned_by": "engine", "rank_from": [r"cmdline:w-(\d+)"]},
            },
            None,
        ),
    ],
)
def test_early_rules_are_written_only_where_a_rule_names_the_rank_before_the_worker_runs(
    doc: dict[str, Any], expected: str | None
) -> None:
    env = engine_env(doc)
    assert env.get(EARLY_ENV) == expected
    if expected is not None:
        assert env["PYTHONPATH"].split(os.pathsep)[0] == HOOK_DIR
        assert env[HOOK_ENV] == f"pid={os.getpid()}"
        assert json.loads(env[RANK_SLOTS_ENV]) == json.loads(rank_slots_value(placement()))


def test_the_engine_that_spawns_workers_gets_mpol_local_and_spawned_workers_bind() -> None:
    config = parse_config(TORCHRUN)
    specs = build_specs(config, placement(), {}, supervisor_pid=1)
    assert specs[0].key == "engine" and specs[0].mempolicy == "local"
    spawned = parse_config({"engine": {"command": ["e"]}, "workers": {"command": ["w"]}})
    assert {s.mempolicy for s in build_specs(spawned, placement(), {}, supervisor_pid=1)} == {
        "bind"
    }


# The launcher stands for the engine (this test process for the supervisor):
# it runs each worker program given on its command line and waits.
LAUNCHER = """
import os, subprocess, sys
for code, extra in zip(sys.argv[1::2], sys.argv[2::2]):
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in extra.split(",") if kv))
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
"""
PLAIN = "from tests.support.fake_engine.workers import report; import sys; report(sys.argv[1])"
MP = """
import multiprocessing, sys
from tests.support.fake_engine import workers
method, kind, out = sys.argv[1:4]
ctx = multiprocessing.get_context(method)
if kind == "vllm":
    p = ctx.Process(target=workers.WorkerProc.worker_main, kwargs={"out": out, "local_rank": 1})
elif kind == "sglang":
    args = (None, None, 1, 0)  # server_args, port_args, gpu_id, tp_rank
    p = ctx.Process(target=workers.run_scheduler_process, args=args, kwargs={"out": out})
else:
    p = ctx.Process(target=workers.unrelated_target, args=(out, 1))
p.start(); p.join(); sys.exit(p.exitcode)
"""


def run_tree(env: dict[str, str], program: str, *args: str, extra: str = "") -> dict[str, Any]:
    out = Path(args[-1])
    code = f"import sys; sys.argv[1:] = {list(args)!r}\n" + program
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, code, extra],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "placement-supervisor hook" not in done.stderr, done.stderr
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_an_env_rank_worker_starts_on_its_ranks_cpus_with_mpol_bind(tmp_path: Path) -> None:
    env = engine_env(TORCHRUN)
    rank1 = run_tree(env, PLAIN, str(tmp_path / "r1.json"), extra="LOCAL_RANK=1")
    rank0 = run_tree(env, PLAIN, str(tmp_path / "r0.json"), extra="LOCAL_RANK=0")
    none = run_tree(env, PLAIN, str(tmp_path / "none.json"))
    assert (rank1["cpus"], rank1["policy"]) == ([1], "bind:0")
    assert (rank0["cpus"], rank0["policy"]) == ([0], "bind:0")
    # No rank in its environment: left as it was (the daemon may adopt it later).
    assert none["policy"] == "default" and none["cpus"] == sorted(os.sched_getaffinity(0))


def test_a_process_outside_the_supervisors_tree_is_not_bound_early(tmp_path: Path) -> None:
    env = engine_env(TORCHRUN)
    # A supervisor pid that is no ancestor of the tree: a copied environment.
    env[HOOK_ENV] = f"pid={os.getppid() + 1_000_000}"
    out = run_tree(env, PLAIN, str(tmp_path / "r1.json"), extra="LOCAL_RANK=1")
    assert out["policy"] == "default"


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize(
    ("kind", "command"),
    [
        ("vllm", ["vllm", "serve", "m", "-tp", "2"]),
        ("sglang", ["python", "-m", "sglang.launch_server", "--tp", "2"]),
    ],
)
def test_a_multiprocessing_worker_is_bound_before_its_target_runs(
    tmp_path: Path, method: str, kind: str, command: list[str]
) -> None:
    env = engine_env({"engine": {"command": command}, "workers": {"spawned_by": "engine"}})
    out = run_tree(env, MP, method, kind, str(tmp_path / "w.json"))
    assert (out["cpus"], out["policy"]) == ([1], "bind:0")
    other = run_tree(env, MP, method, "other", str(tmp_path / "o.json"))
    assert other["policy"] == "default"
