"""The example configs against what real engines do (their titles, thread names, flags).

Every `[threads.*]` pattern under configs/ must match a thread name a real
runtime sets (each listed here with where it comes from), and NCCL's names
only where the config sets NCCL_SET_THREAD_NAME=1. configs/engines/ holds
the vLLM, SGLang, torchrun and Ray examples: they start engines that spawn their
own workers, so they use `[workers] spawned_by` / `rank_from` (docs/contracts.md §6).
Where this branch's loader does not know those keys yet, the file is loaded
with them swapped for a stand-in command and the keys are checked here.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import Config, parse_config
from supervisor.engines.kind_rules import rules_for
from supervisor.engines.rank_source import ProcFacts
from supervisor.errors import ConfigError
from supervisor.plan.threads import COMM_MAX_CHARS, unmatchable_patterns
from supervisor.run.stop_budget import stage_until_s, worst_stop_s

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
ENGINES = CONFIGS / "engines"
ALL = sorted([*CONFIGS.glob("*.toml"), *ENGINES.glob("*.toml")])

# Thread names (comm, what /proc/<pid>/task/<tid>/comm shows) that real code sets.
REAL_NAMES = {
    # torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp via c10::setThreadName (15 bytes)
    "pt_nccl_watchdg": "pytorch",
    "pt_nccl_heartbt": "pytorch",
    "pt_nccl_gil_chk": "pytorch",
    # NCCL src/proxy.cc via ncclSetThreadName, only with NCCL_SET_THREAD_NAME=1
    "NCCL Progress 0": "nccl",
    "NCCL Service  0": "nccl",
    "NCCL UDS Servic": "nccl",
    # vllm-ascend's binder matches these (vllm_ascend/cpu_binding.py)
    "acl_thread": "ascend",
    "release_thread": "ascend",
    # this project's start-up hook (supervisor/hook) and supervisor.worker
    "so_compiler-0": "hook",
    "so-compile-0": "worker",
    # the demo programs (supervisor/demo/worker.py)
    "comm": "demo",
    "release": "demo",
}
NEEDS_ADOPTION = ("spawned_by", "rank_from", "waiting_warning_s")
DEFAULT_STOP_TIMEOUT_S = parse_config({"workers": {"command": ["w"]}}).stop_timeout_s


def raw(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return tomllib.load(f)


def load_example(path: Path) -> Config:
    """The config as this branch's loader reads it; the adoption keys swapped
    for a stand-in command only where the loader does not know them."""
    doc = raw(path)
    try:
        return parse_config(doc, str(path))
    except ConfigError as err:
        workers = doc.get("workers", {})
        if "workers.command: is required" not in str(err) or "spawned_by" not in workers:
            raise
    workers = {k: v for k, v in doc["workers"].items() if k not in NEEDS_ADOPTION}
    return parse_config({**doc, "workers": {**workers, "command": ["true"]}}, str(path))


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_pattern_matches_a_real_thread_name(path: Path) -> None:
    config = load_example(path)
    assert unmatchable_patterns(config.threads) == []
    doc = raw(path)
    nccl_named = any(
        doc.get(kind, {}).get("env", {}).get("NCCL_SET_THREAD_NAME") == "1"
        for kind in ("engine", "workers")
    )
    for role in config.threads:
        matched = {
            source
            for name, source in REAL_NAMES.items()
            if fnmatchcase(name[:COMM_MAX_CHARS], role.pattern)
        }
        assert matched, f"{path.name}: {role.role} pattern {role.pattern!r} matches no real name"
        if "nccl" in matched:
            assert nccl_named, f"{path.name}: {role.pattern!r} needs NCCL_SET_THREAD_NAME=1"
        if role.executors:
            assert matched == {"hook"}


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_engine_commands_name_the_engines_own_environment(path: Path) -> None:
    config = load_example(path)
    # An attached engine (docs/attach.md) has no command of ours.
    commands = [config.engine.command] if config.engine and config.engine.command else []
    if "spawned_by" not in raw(path)["workers"]:
        commands.append(config.workers.command)
    for argv in commands:
        if path.name == "demo.toml":  # the demo is this package: the supervisor's python
            continue
        assert argv[0].startswith("/"), f"{path.name}: {argv[0]!r} would be the supervisor's"


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    flag: str  # the engine's own binding, which must stay off
    executor: str | None = None
    title: str | None = None  # a worker's real process title ...
    rank: int | None = None  # ... and the rank in it
    not_a_worker: str | None = None  # a title of the same tree that is no rank


ENGINE_CASES = [
    Engine(
        "vllm.toml",
        "--numa-bind",
        "vllm.v1.structured_output",
        "VLLM::Worker_TP3",
        3,
        "VLLM::EngineCore",
    ),
    Engine(
        "sglang.toml",
        "--numa-node",
        "sglang.srt.constrained",
        "sglang::scheduler_TP5",
        5,
        "sglang::detokenizer",
    ),
    Engine("torchrun.toml", "--numa-binding"),
]


@pytest.mark.parametrize("case", ENGINE_CASES, ids=lambda c: c.name)
def test_engine_examples_adopt_by_the_engines_own_titles_and_bind_nothing_themselves(
    case: Engine,
) -> None:
    name, executor, title, rank, flag = case.name, case.executor, case.title, case.rank, case.flag
    path = ENGINES / name
    doc = raw(path)
    config = load_example(path)
    assert doc["workers"]["spawned_by"] == "engine"
    # The engine's kind names the ranks: no rank_from to keep in step with its titles.
    assert "rank_from" not in doc["workers"]
    assert config.engine is not None
    assert doc["engine"]["kind"] == config.engine.kind == name.removesuffix(".toml")
    rules = rules_for(config.engine.kind, config.engine.command, config.engine.env)
    if title is None:
        assert rules.name(ProcFacts({"LOCAL_RANK": "3"}, "python serve.py")).local_rank == 3
    else:
        assert rules.name(ProcFacts({}, title)).local_rank == rank
        assert rules.name(ProcFacts({}, f"{title[:-1]}7")).local_rank == 7  # the last of -tp 8
        assert not rules.name(ProcFacts({}, str(case.not_a_worker))).expected
        # comm keeps 15 bytes, which hold no rank: the title is read from the cmdline.
        assert rules.name(ProcFacts({}, title[:COMM_MAX_CHARS])).local_rank is None
    hooked = [r for r in config.threads if r.executors]
    if executor is None:
        assert hooked == []
    else:
        assert [r.executors for r in hooked] == [(executor,)]
        assert all(r.role == "so_compiler" for r in hooked)
    # The engine's own binding is off: the flag is not passed, and the file says why.
    assert config.engine is not None and flag not in config.engine.command
    assert flag in path.read_text()
    if name == "sglang.toml":
        assert config.engine.env["SGLANG_AUTO_NUMA_BIND"] == "0"


def test_the_engines_page_says_which_engine_flag_to_turn_off() -> None:
    text = (REPO / "docs/engines.md").read_text()
    for needle in ("--numa-bind", "SGLANG_AUTO_NUMA_BIND", "--numa-node", "--numa-binding"):
        assert needle in text
    for name in ("vllm.toml", "sglang.toml", "torchrun.toml"):
        assert f"configs/engines/{name}" in text


def _unit_stop_s() -> float:
    text = (REPO / "systemd" / "placement-supervisor.service").read_text()
    match = re.search(r"^TimeoutStopSec=(\d+)$", text, re.M)
    assert match is not None
    return float(match.group(1))


def _rays_default_drain_s() -> float | None:
    """Ray's own RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S default, read from the installed
    Ray's source (not imported: that starts nothing but takes seconds); None without Ray."""
    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        return None
    text = (Path(spec.origin).parent / "_private" / "ray_constants.py").read_text()
    match = re.search(r'"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S",\s*([\d.]+)', text)
    assert match is not None, "Ray no longer defines RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
    return float(match.group(1))


def test_the_ray_config_outlasts_rays_drain() -> None:
    path = ENGINES / "ray.toml"
    doc = raw(path)
    config = load_example(path)
    assert config.engine is not None and config.engine.kind == "ray"
    assert config.engine.command[1:3] == ("start", "--block")
    assert doc["workers"]["spawned_by"] == "engine" and "rank_from" not in doc["workers"]
    drain_s = float(config.engine.env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
    default = _rays_default_drain_s()
    if default is not None:
        assert drain_s >= default, f"the config pins a drain below Ray's own {default} s"
    # The drain, then Ray's teardown of its process types (1 s each): 10 s of room.
    assert config.stop_timeout_s >= drain_s + 10
    assert config.stop_timeout_s > DEFAULT_STOP_TIMEOUT_S  # the default would SIGKILL it
    # The grace does not cut the engine's wait below that, and fits the unit's.
    assert config.stop_grace_s is not None
    assert stage_until_s(config.stop_grace_s, "engine", has_engine=True) >= config.stop_timeout_s
    assert config.stop_grace_s <= _unit_stop_s()


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_stops_within_the_units_timeout(path: Path) -> None:
    config = load_example(path)
    worst = worst_stop_s(config.stop_timeout_s, config.engine is not None)
    if config.stop_grace_s is not None:
        worst = min(worst, config.stop_grace_s)
    assert worst <= _unit_stop_s(), f"{path.name}: a stop may take {worst} s"
