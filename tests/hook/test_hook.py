"""The engine start-up hook (supervisor/hook/) in real Python processes, and its config.

Children are real interpreters started with the environment the spawner
builds (`hook_env`, `build_specs`); what they report is read from their own
/proc. The xgrammar tests run a front process, a multiprocessing spawn child
and an unnamed pool in a listed module compiling real grammars, and sample
every thread of that child while it compiles: under the spawner + shim, and
under the real daemon. This box has 2 CPUs: so_compiler gets CPU 1 and the
process CPUs 0-1, so a thread the hook missed shows "0-1" and fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import parse_config
from supervisor.errors import ConfigError
from supervisor.hook import HOOK_DIR, HOOK_ENV, hook_env, hook_roles
from supervisor.plan.keys import ThreadRole
from supervisor.plan.placement import Placement, Slot
from supervisor.plan.threads import role_for_thread
from supervisor.run.spec import build_specs
from supervisor.worker import SLOT_ENV, slot_env_value
from tests.support.children import close_process, start_shimmed, status_field
from tests.support.daemon_support import (
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

REPO = Path(__file__).resolve().parents[2]
POOLS = "tests.support.fake_engine.pools"
COMPILER = "tests.support.fake_engine.structured_output"
SLOT_DOC = {"cpus": [0, 1], "mems": [0], "roles": {"main": [0], "so_compiler": [1]}}
SLOT = slot_env_value("engine", SLOT_DOC)
HOOK_FILE = str(Path(HOOK_DIR) / "sitecustomize.py")

# What a child prints about itself and its pools (POOLS is the listed module).
POOL_PROGRAM = """
import json, sys
hooked_at_start = any(type(f).__name__ == "PatchOnImport" for f in sys.meta_path)
imported_at_start = "concurrent.futures.thread" in sys.modules
from concurrent.futures import ThreadPoolExecutor
from tests.support.fake_engine import pools
calls = []
listed = pools.make_pool(8, initializer=calls.append, initargs=("ran",))
default = pools.make_pool()
subclass = pools.make_compiler_pool()
subclass_elsewhere = pools.CompilerPool()
unlisted = ThreadPoolExecutor(max_workers=2)
print(json.dumps({
    "hooked_at_start": hooked_at_start,
    "imported_at_start": imported_at_start,
    "patched": getattr(ThreadPoolExecutor.__init__, "_placement_supervisor_hook", False),
    "listed": [listed._max_workers, pools.report(listed, 8), calls],
    "default": default._max_workers,
    "subclass": [subclass._max_workers, pools.report(subclass, 8)],
    "subclass_elsewhere": subclass_elsewhere._max_workers,
    "unlisted": [unlisted._max_workers, pools.report(unlisted, 2)],
    "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
}))
"""


def assert_two_cpus() -> None:
    # Not a skip (CI fails skips): every test box here has CPUs 0 and 1.
    assert {0, 1} <= os.sched_getaffinity(0), "these tests need CPUs 0 and 1"


def child_env(
    roles: dict[str, tuple[str, ...]] | None = None,
    supervisor_pid: int | None = None,
    pythonpath: str = str(REPO),
    **extra: str,
) -> dict[str, str]:
    """This environment as the spawner leaves it for a hooked child."""
    env = {k: v for k, v in os.environ.items() if k not in (HOOK_ENV, SLOT_ENV)}
    env["PYTHONPATH"] = pythonpath
    env[SLOT_ENV] = SLOT
    roles = {"so_compiler": (POOLS,)} if roles is None else roles
    pid = os.getpid() if supervisor_pid is None else supervisor_pid
    env.update(hook_env(env, roles, pid))
    env.update(extra)
    return env


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def pool_report(env: dict[str, str]) -> tuple[dict[str, Any], str]:
    done = run_python(POOL_PROGRAM, env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


# -- config -------------------------------------------------------------------------------------


def config_doc(**threads: Any) -> dict[str, Any]:
    return {"workers": {"command": ["true"]}, "threads": threads}


def test_executors_default_their_pattern_to_the_hooks_names_and_roles_match_them() -> None:
    config = parse_config(
        config_doc(
            so_compiler={"process": "engine", "executors": ["vllm.v1.structured_output"]},
            sched={"process": "workers", "role": "so_compiler", "executors": ["sglang.srt"]},
        )
    )
    engine, workers = config.threads
    assert engine == ThreadRole(
        "so_compiler", "engine", "so_compiler-[0-9]*", ("vllm.v1.structured_output",)
    )
    assert workers.role == "so_compiler" and workers.pattern == "so_compiler-[0-9]*"
    # The daemon's matching (plan/threads.py) gives the hook's names the role,
    # also past 15 bytes ("so_compiler-1234" is kept as "so_compiler-123").
    for name in ("so_compiler-0", "so_compiler-17", "so_compiler-1234"):
        assert role_for_thread(name, "engine", config.threads) == "so_compiler"
    assert role_for_thread("so_compilerX", "engine", config.threads) == "main"
    assert role_for_thread("ThreadPoolExec", "engine", config.threads) == "main"
    assert hook_roles(config.threads, ("engine",)) == {
        "so_compiler": ("vllm.v1.structured_output",)
    }
    assert hook_roles(config.threads, ("workers",)) == {"so_compiler": ("sglang.srt",)}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"process": "engine", "executors": ["vllm..v1"]},
            "threads.so_compiler.executors: item 0: expected a module name",
        ),
        ({"process": "engine", "executors": []}, "threads.so_compiler.executors: must name"),
        ({"process": "engine", "executors": "vllm"}, "threads.so_compiler.executors: expected"),
        ({"process": "engine", "executors": [3]}, "threads.so_compiler.executors: item 0 must"),
        (
            {"process": "engine", "executors": ["vllm"], "pattern": "so-compile*"},
            "threads.so_compiler.pattern: 'so-compile*' does not match the hook's thread names",
        ),
        (
            {"process": "engine", "executors": ["vllm"], "role": "structured_output"},
            "threads.so_compiler.role: role 'structured_output' names the hook's threads",
        ),
    ],
)
def test_bad_executors_are_one_error_naming_the_key(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match="^<config>: " + message.replace("*", r"\*")):
        parse_config(config_doc(so_compiler=table))


def test_a_wider_pattern_that_matches_the_hooks_names_is_kept() -> None:
    table = {"process": "engine", "executors": ["vllm"], "pattern": "so[-_]compile*"}
    (role,) = parse_config(config_doc(so_compiler=table)).threads
    assert role.pattern == "so[-_]compile*" and role.executors == ("vllm",)


def test_hook_env_puts_the_hook_first_keeps_the_path_and_only_where_roles_ask() -> None:
    roles = {"so_compiler": ("vllm.v1.structured_output", "sglang.srt.constrained")}
    env = hook_env({"PYTHONPATH": f"/a::/b{os.pathsep}{HOOK_DIR}"}, roles, 42)
    assert env["PYTHONPATH"] == os.pathsep.join([HOOK_DIR, "/a", "", "/b"])
    assert env[HOOK_ENV] == "pid=42;so_compiler=vllm.v1.structured_output,sglang.srt.constrained"
    assert hook_env({}, roles, 42)["PYTHONPATH"] == HOOK_DIR
    assert hook_env({"PYTHONPATH": ""}, roles, 42)["PYTHONPATH"] == HOOK_DIR  # not "" = cwd
    assert hook_env({"PYTHONPATH": "/a"}, {}, 42) == {}
    # Nothing there may shadow an engine's own top-level module: sitecustomize
    # and the early-bind module, whose name no engine uses.
    files = {"sitecustomize.py", "placement_supervisor_early.py"}
    assert set(os.listdir(HOOK_DIR)) - {"__pycache__"} == files


def test_build_specs_hooks_the_engine_tree_by_its_roles_and_workers_by_theirs() -> None:
    config = parse_config(
        {
            "engine": {"command": ["engine"], "env": {"PYTHONPATH": "/opt/engine"}},
            "workers": {"command": ["worker"]},
            "threads": {
                "so_compiler": {"process": "engine", "executors": ["vllm.v1.structured_output"]},
                "comm": {"process": "workers", "pattern": "pt_nccl*"},
            },
        }
    )
    slot = Slot((0, 1), (0,), {"main": (0,), "so_compiler": (1,)})
    placement = Placement("numa-affine", slot, ())
    (engine,) = build_specs(config, placement, {"PATH": "/usr/bin"}, supervisor_pid=7)
    assert engine.env["PYTHONPATH"] == os.pathsep.join([HOOK_DIR, "/opt/engine"])
    assert engine.env[HOOK_ENV] == "pid=7;so_compiler=vllm.v1.structured_output"
    assert json.loads(engine.env[SLOT_ENV])["roles"]["so_compiler"] == [1]
    without = parse_config({"engine": {"command": ["engine"]}, "workers": {"command": ["w"]}})
    (plain,) = build_specs(without, placement, {"PATH": "/usr/bin"})
    assert HOOK_ENV not in plain.env and "PYTHONPATH" not in plain.env


def test_an_engine_that_spawns_the_workers_carries_their_hook_roles_too() -> None:
    """Adopted workers inherit the engine's environment (SGLang's schedulers)."""
    config = parse_config(
        {
            "engine": {"command": ["engine"]},
            "workers": {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]},
            "threads": {
                "so_compiler": {"process": "engine", "executors": ["sglang.srt.constrained"]},
                "sampler": {"process": "workers", "executors": ["sglang.srt.sampling"]},
            },
        }
    )
    slot = Slot((0, 1), (0,), {"main": (0,), "so_compiler": (1,)})
    (engine,) = build_specs(config, Placement("numa-affine", slot, ()), {}, supervisor_pid=7)
    assert engine.env[HOOK_ENV] == (
        "pid=7;so_compiler=sglang.srt.constrained;sampler=sglang.srt.sampling"
    )


# -- the hook in real interpreters -------------------------------------------------------------


def test_a_pool_made_in_a_listed_module_is_named_capped_and_bound() -> None:
    assert_two_cpus()
    report, stderr = pool_report(child_env())
    assert stderr == ""
    # Lazy: nothing of concurrent.futures at start-up, a finder waits for it.
    assert report["hooked_at_start"] and not report["imported_at_start"] and report["patched"]
    max_workers, threads, calls = report["listed"]
    assert max_workers == 1  # 8 asked, so_compiler has 1 CPU in the slot
    assert [(t["comm"], t["cpus"]) for t in threads] == [("so_compiler-0", [1])]
    assert calls == ["ran"]  # the caller's own initializer still runs, with its initargs
    assert report["default"] == 1  # max_workers=None: the plan's count, not os.cpu_count()
    # A subclass calling super().__init__ is judged by the module that made it.
    max_workers, threads = report["subclass"]
    assert max_workers == 1
    assert [(t["comm"], t["cpus"]) for t in threads] == [("so_compiler-1", [1])]
    assert report["subclass_elsewhere"] == 8  # made in __main__, though defined in POOLS
    # A pool made anywhere else is left as it was.
    max_workers, threads = report["unlisted"]
    assert max_workers == 2
    assert all(not t["comm"].startswith("so_compiler") and t["cpus"] == [0, 1] for t in threads)


def test_the_hook_chains_to_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "import sys\nsys.stderr.write('their sitecustomize ran\\n')\nTHEIRS = True\n"
    )
    path = os.pathsep.join([str(theirs), str(REPO)])
    hooked = child_env(pythonpath=path)
    for env, hook_on in ((hooked, True), ({**hooked, HOOK_ENV: ""}, False)):
        report, stderr = pool_report(env)
        assert stderr == "their sitecustomize ran\n"  # once, hooked or not
        assert report["sitecustomize"] == str(theirs / "sitecustomize.py")
        assert (report["listed"][1][0]["comm"] == "so_compiler-0") is hook_on


def test_a_failing_shadowed_sitecustomize_is_reported_as_python_would(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("raise RuntimeError('theirs is broken')\n")
    report, stderr = pool_report(child_env(pythonpath=os.pathsep.join([str(theirs), str(REPO)])))
    assert "Error in sitecustomize" in stderr and "theirs is broken" in stderr
    assert report["listed"][1][0]["comm"] == "so_compiler-0"  # ours was installed first


@pytest.mark.parametrize(
    ("change", "event"),
    [
        ({HOOK_ENV: "pid=1;so_compiler"}, "start-up"),  # a variable it cannot read
        ({HOOK_ENV: "garbage"}, "start-up"),
        ({SLOT_ENV: "{not json"}, "pool"),  # a slot it cannot read, at pool creation
    ],
)
def test_a_failing_hook_logs_once_and_the_process_runs_unhooked(
    change: dict[str, str], event: str
) -> None:
    report, stderr = pool_report({**child_env(), **change})
    (line,) = stderr.splitlines()  # one line, however many pools
    assert line.startswith(f"placement-supervisor hook: {event} ")
    assert line.endswith(" action=unhooked")
    max_workers, threads, calls = report["listed"]
    assert max_workers == 8 and calls == ["ran"] * len(threads)
    assert not threads[0]["comm"].startswith("so_compiler")


def test_the_hook_is_stdlib_only_and_isolated_interpreters_are_not_hooked() -> None:
    """`python -I` ignores PYTHONPATH, so the hook cannot reach it (documented);
    loaded by hand into `python -I -S` (no site-packages at all) it works."""
    find_repo = f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
    isolated = subprocess.run(
        [sys.executable, "-I", "-c", find_repo + POOL_PROGRAM],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert isolated.returncode == 0, isolated.stderr
    report = json.loads(isolated.stdout.splitlines()[-1])
    assert not report["patched"] and report["listed"][0] == 8
    load = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('sitecustomize', {HOOK_FILE!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['sitecustomize'] = module\n"
        "spec.loader.exec_module(module)\n"
    )
    by_hand = subprocess.run(
        [sys.executable, "-I", "-S", "-c", find_repo + load + POOL_PROGRAM],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert by_hand.returncode == 0 and by_hand.stderr == "", by_hand.stderr
    report = json.loads(by_hand.stdout.splitlines()[-1])
    assert report["patched"] and report["listed"][0] == 1


def test_a_process_outside_the_supervisors_tree_is_untouched() -> None:
    assert_two_cpus()
    # A live process that is not our ancestor: a copied environment names it.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        report, stderr = pool_report(child_env(supervisor_pid=stranger.pid))
    finally:
        close_process(stranger)
    assert stderr == ""
    assert not report["hooked_at_start"] and not report["patched"]
    max_workers, threads, _ = report["listed"]
    assert max_workers == 8
    assert all(t["comm"] != "so_compiler-0" and t["cpus"] == [0, 1] for t in threads)


def test_an_adopted_process_outside_the_slots_cpuset_is_named_but_left_to_the_daemon(
    tmp_path: Path,
) -> None:
    """The slot variable is inherited: an engine's child the daemon adopted into
    a rank's cgroup still carries the engine's slot. The hook then names and
    caps its pool but does not bind it to CPUs outside its cpuset."""
    if os.geteuid() != 0 or not Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists():
        pytest.fail("needs root and the cgroup v1 cpuset hierarchy (as the other cgroup tests)")
    from tests.support.cgroup_v1 import v1_cpuset  # noqa: PLC0415

    with v1_cpuset(f"ps-hook-{os.getpid()}", cpus="0") as cg:
        join = f"open({str(cg / 'cgroup.procs')!r}, 'w').write(str(__import__('os').getpid()))\n"
        done = run_python(join + POOL_PROGRAM, child_env())
        # Made in the engine's slot, adopted before its first thread starts:
        # the decision is taken per thread, so it is not bound either.
        late = run_python(
            "from tests.support.fake_engine import pools\n"
            "import json\n"
            "pool = pools.make_pool()\n" + join + "print(json.dumps(pools.report(pool, 1)))\n",
            child_env(),
        )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    max_workers, threads, _ = report["listed"]
    assert max_workers == 1
    assert [(t["comm"], t["cpus"]) for t in threads] == [("so_compiler-0", [0])]
    assert late.returncode == 0 and late.stderr == "", late.stderr
    assert [(t["comm"], t["cpus"]) for t in json.loads(late.stdout)] == [("so_compiler-0", [0])]


# -- real xgrammar in an engine-shaped process tree --------------------------------------------


def sample_compiler_threads(out: Path, seconds: float) -> dict[int, tuple[set[str], set[str]]]:
    """{tid: (Cpus_allowed_list values, comms)} of every thread of the compiling
    child but its main thread and the threads it had before the pool, sampled
    over and over for `seconds` while it compiles."""
    doc = json.loads((out / "pool.json").read_text())
    pid = doc["pid"]
    skip = {pid, *doc["before"]}
    assert len(doc["before"]) <= 3, doc  # the main thread and torch's import thread
    seen: dict[int, tuple[set[str], set[str]]] = defaultdict(lambda: (set(), set()))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name in os.listdir(f"/proc/{pid}/task"):
            tid = int(name)
            if tid in skip:
                continue
            try:
                cpus = status_field(f"{pid}/task/{tid}", "Cpus_allowed_list")
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                continue  # a compile thread that ended between listdir and read
            seen[tid][0].add(cpus)
            seen[tid][1].add(comm)
    return dict(seen)


def assert_compiler_threads_on_cpu1(out: Path) -> None:
    poll((out / "pool.json").exists, timeout_s=120, what="the child's first compile")
    assert json.loads((out / "pool.json").read_text())["max_workers"] == 1
    seen = sample_compiler_threads(out, seconds=2.0)
    (out / "stop").write_text("")
    # The pool thread and xgrammar's per-compile threads (8 per compile).
    assert len(seen) >= 9, seen
    wrong = {tid: cpus for tid, (cpus, _) in seen.items() if cpus != {"1"}}
    assert not wrong, f"threads off so_compiler's CPU 1: {wrong}"
    # xgrammar's threads carry no name of their own: they inherit the pool
    # thread's, so the daemon's role match finds them too.
    assert {c for _, comms in seen.values() for c in comms} == {"so_compiler-0"}
    poll((out / "compiled").exists, timeout_s=60, what="the child to stop")
    assert int((out / "compiled").read_text()) > 0


def test_xgrammar_compile_threads_of_a_spawn_child_sit_on_so_compiler_under_the_spawner(
    tmp_path: Path,
) -> None:
    assert_two_cpus()
    out = tmp_path / "out"
    out.mkdir()
    config = parse_config(
        {
            "engine": {
                "command": [sys.executable, "-m", "tests.support.fake_engine.front", str(out)],
                "env": {"PYTHONPATH": str(REPO)},
            },
            "workers": {"command": ["true"]},
            "threads": {"so_compiler": {"process": "engine", "executors": [COMPILER]}},
        }
    )
    slot = Slot((0, 1), (0,), {"main": (0,), "so_compiler": (1,)})
    environ = {k: v for k, v in os.environ.items() if k not in (HOOK_ENV, SLOT_ENV)}
    (spec,) = build_specs(config, Placement("numa-affine", slot, ()), environ)
    proc, report = start_shimmed(slot.cpus, slot.mems, spec.argv, env=spec.env, cwd=tmp_path)
    try:
        assert report.cpus == (0, 1)
        assert_compiler_threads_on_cpu1(out)
        assert proc.wait(timeout=60) == 0
    finally:
        close_process(proc)


def test_xgrammar_compile_threads_of_a_spawn_child_sit_on_so_compiler_under_the_daemon(
    tmp_path: Path,
) -> None:
    """The daemon plans, spawns through the shim into its cgroup, and sets the
    hook's variables. On 2 CPUs the planner gives an engine 1 CPU, so the front
    process runs as rank 0 (CPUs 0-1, so_compiler 1) with `process = "workers"`."""
    assert_two_cpus()
    out = tmp_path / "out"
    out.mkdir()
    doc = {
        "cpu_ranks": 1,
        "cgroup": "auto",
        "stop_timeout_s": 5,
        "workers": {
            "command": [sys.executable, "-m", "tests.support.fake_engine.front", str(out)],
            "env": {"PYTHONPATH": str(REPO)},
        },
        "placement": {"rank_roles": {"so_compiler": 1}, "engine": {"enabled": False}},
    }
    text = to_toml(doc)
    text += f'[threads.so_compiler]\nprocess = "workers"\nexecutors = ["{COMPILER}"]\n'
    config = tmp_path / "hook.toml"
    config.write_text(text)
    with DaemonProcess(config, tmp_path / "daemon.log", env=daemon_env()) as daemon:
        placed = poll(daemon.running, timeout_s=60)
        assert placed["ranks"][0]["roles"] == {"main": [0], "so_compiler": [1]}
        assert_compiler_threads_on_cpu1(out)
