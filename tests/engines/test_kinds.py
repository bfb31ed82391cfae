"""The engine kinds' own rules as tables (DESIGN 3.6): recognising the kind from the
command, the layouts read from the engines' flags, every title of every parallel
layout named to its local device, the device winning over a title, the waiting
warning's decision, and the config's `[engine] kind`.
"""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.config import parse_config
from supervisor.engines.engine_kind import recognise_kind, sglang_layout, vllm_layout
from supervisor.engines.kind_rules import KindRules, name_sglang, name_vllm, rules_for, title_parts
from supervisor.engines.naming import Verdict, decide_rank, waiting_warnings
from supervisor.engines.rank_source import ProcFacts, parse_rank_source
from supervisor.errors import ConfigError

IDENTITY = {i: i for i in range(16)}  # local rank -> rank; device index -> rank


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["vllm", "serve", "m", "-tp", "2"], "vllm"),
        (["/opt/vllm/bin/vllm", "serve", "m"], "vllm"),
        (["vllm", "chat"], "custom"),
        (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], "vllm"),
        (["/opt/v/bin/python3.11", "-u", "-m", "vllm.entrypoints.cli.main", "serve"], "vllm"),
        (["python3", "-m", "sglang.launch_server", "--tp", "2"], "sglang"),
        (["torchrun", "--nproc-per-node", "8", "t.py"], "torchrun"),
        (["python", "-m", "torch.distributed.run", "t.py"], "torchrun"),
        (["ray", "start", "--head", "--block"], "ray"),
        (["ray", "status"], "custom"),
        (["python", "serve.py", "-m", "vllm.entrypoints"], "custom"),  # a script, not -m
        (["./engine"], "custom"),
        ([], "custom"),
    ],
)
def test_recognise_kind(argv: list[str], kind: str) -> None:
    assert recognise_kind(argv) == kind


def test_layouts_read_the_engines_flags_with_their_defaults() -> None:
    v = vllm_layout(["vllm", "serve", "m"])
    assert (v.tp, v.pp, v.dp, v.dp_local, v.dp_start, v.world) == (1, 1, 1, 1, 0, 1)
    assert v.core_drives_device
    v = vllm_layout(["vllm", "serve", "m", "-tp=4", "--pipeline-parallel-size", "2", "-dp", "4"])
    assert (v.tp, v.pp, v.dp, v.dp_local, v.world) == (4, 2, 4, 4, 8)
    assert not v.core_drives_device
    v = vllm_layout(["vllm", "serve", "-dp", "4", "-dpl", "2", "-dpr", "2", "--headless"])
    assert (v.dp, v.dp_local, v.dp_start) == (4, 2, 2)
    assert not vllm_layout(
        ["vllm", "serve", "--distributed-executor-backend", "mp"]
    ).core_drives_device
    s = sglang_layout(["python", "-m", "sglang.launch_server", "--tp", "4", "--dp-size", "2"])
    assert (s.tp, s.dp, s.pp, s.base_gpu_id, s.gpu_id_step) == (4, 2, 1, 0, 1)
    s = sglang_layout(["x", "--tp-size=2", "--base-gpu-id", "4", "--gpu-id-step", "2"])
    assert (s.tp, s.base_gpu_id, s.gpu_id_step) == (2, 4, 2)
    with pytest.raises(ValueError, match="--tensor-parallel-size 'two': not an integer"):
        vllm_layout(["vllm", "serve", "--tensor-parallel-size", "two"])


def test_title_parts() -> None:
    assert title_parts("") == {}
    assert title_parts("_DP1_PP0_TP3_EP7") == {"DP": 1, "PP": 0, "TP": 3, "EP": 7}
    assert title_parts("_ATTN_CP1_TP0") == {"ATTN_CP": 1, "TP": 0}
    assert title_parts("_TP") is None
    assert title_parts("Proc") is None


V = ["vllm", "serve", "m"]


@pytest.mark.parametrize(
    ("flags", "title", "local", "expected"),
    [
        # TP only: one worker per GPU.
        (["-tp", "2"], "VLLM::Worker_TP0", 0, True),
        (["-tp", "2"], "VLLM::Worker_TP1", 1, True),
        (["-tp", "2", "--enable-expert-parallel"], "VLLM::Worker_TP1_EP1", 1, True),
        (["-tp", "2"], "VLLM::Worker", None, True),  # before device init: not yet known
        (["-tp", "2"], "VLLM::EngineCore", None, False),  # it has workers: not a rank
        (["-tp", "2"], "vllm serve m -tp 2", None, False),  # the API server
        (["-tp", "2"], "VLLM::APIServer_0", None, False),
        # PP x TP: TP fastest.
        (["-tp", "2", "-pp", "2"], "VLLM::Worker_PP0_TP1", 1, True),
        (["-tp", "2", "-pp", "2"], "VLLM::Worker_PP1_TP0", 2, True),
        (["-pp", "2"], "VLLM::Worker_PP1", 1, True),
        # DP x TP: each local DP engine core gets the next TP x PP devices.
        (["-tp", "2", "-dp", "2"], "VLLM::Worker_DP1_TP0", 2, True),
        (["-tp", "2", "-dp", "2"], "VLLM::Worker_DP0_TP1", 1, True),
        (["-tp", "2", "-dp", "2"], "VLLM::EngineCore_DP1", None, False),
        # A secondary node: DP ranks 2-3 of 4 run here, on devices 0-3.
        (["-tp", "2", "-dp", "4", "-dpl", "2", "-dpr", "2"], "VLLM::Worker_DP3_TP1", 3, True),
        (["-tp", "2", "-dp", "4", "-dpl", "2", "-dpr", "2"], "VLLM::Worker_DP1_TP1", None, True),
        # TP = PP = 1: the engine core drives the GPU (there is no worker).
        ([], "VLLM::EngineCore", 0, True),
        (["-dp", "2"], "VLLM::EngineCore_DP1", 1, True),
        (["-dp", "2"], "VLLM::DPEngineCore_1", 1, True),  # older releases' title
        (["-dp", "4", "-dpl", "2", "-dpr", "2"], "VLLM::EngineCore_DP3", 1, True),
        # ... unless the mp executor is forced: then its one worker does.
        (["--distributed-executor-backend", "mp"], "VLLM::EngineCore", None, False),
        (["--distributed-executor-backend", "mp"], "VLLM::Worker", 0, True),
        (["-tp", "2"], "Other::Worker_TP1", None, False),
    ],
)
def test_vllm_titles(flags: list[str], title: str, local: int | None, expected: bool) -> None:
    naming = name_vllm(vllm_layout(V + flags), "VLLM", title)
    assert (naming.local_rank, naming.expected) == (local, expected)


def test_vllm_prefix_comes_from_the_engine_environment() -> None:
    rules = rules_for("vllm", [*V, "-tp", "2"], {"VLLM_PROCESS_NAME_PREFIX": "LLM"})
    assert rules.name(ProcFacts({}, "LLM::Worker_TP1")).local_rank == 1
    assert not rules.name(ProcFacts({}, "VLLM::Worker_TP1")).expected
    # A process's own environment says what it titles itself with.
    got = rules.name(ProcFacts({"VLLM_PROCESS_NAME_PREFIX": "VLLM"}, "VLLM::Worker_TP1"))
    assert got.local_rank == 1


S = ["python", "-m", "sglang.launch_server", "--model-path", "m"]


@pytest.mark.parametrize(
    ("flags", "title", "local", "expected"),
    [
        (["--tp", "2"], "sglang::scheduler_TP0", 0, True),
        (["--tp", "2"], "sglang::scheduler_TP1", 1, True),
        ([], "sglang::scheduler", 0, True),  # tp = 1
        (["--base-gpu-id", "3"], "sglang::scheduler", 3, True),
        (
            ["--tp", "2", "--base-gpu-id", "1", "--gpu-id-step", "2"],
            "sglang::scheduler_TP1",
            3,
            True,
        ),
        (["--tp", "2", "--dp", "2"], "sglang::scheduler_DP1_TP0", 2, True),
        (["--tp", "2", "--dp", "2"], "sglang::scheduler_DP1_TP1", 3, True),
        (["--dp", "2"], "sglang::scheduler_DP1", 1, True),
        # DP attention: the DP ranks split one TP group's GPUs.
        (["--tp", "4", "--dp", "2", "--enable-dp-attention"], "sglang::scheduler_DP1_TP3", 3, True),
        (["--tp", "2", "--pp", "2"], "sglang::scheduler_PP1_TP1", 3, True),
        (["--tp", "4", "--ep", "2"], "sglang::scheduler_TP3_EP1", 3, True),
        (["--tp", "2"], "sglang::detokenizer", None, False),
        (["--dp", "2"], "sglang::data_parallel_controller", None, False),
        (["--tp", "2"], "python -m sglang.launch_server", None, False),
    ],
)
def test_sglang_titles(flags: list[str], title: str, local: int | None, expected: bool) -> None:
    naming = name_sglang(sglang_layout(S + flags), title)
    assert (naming.local_rank, naming.expected) == (local, expected)


def test_torchrun_and_ray_rules() -> None:
    torchrun = rules_for("torchrun", ["torchrun", "t.py"], {})
    assert torchrun.name(ProcFacts({"LOCAL_RANK": "3"}, "python t.py")).local_rank == 3
    assert not torchrun.name(ProcFacts({}, "torchrun t.py")).expected
    ray = rules_for("ray", ["ray", "start", "--head"], {})
    assert ray.name(ProcFacts({}, "ray::Worker")).expected
    assert ray.name(ProcFacts({}, "ray::Worker")).local_rank is None  # the device names it
    assert not ray.name(ProcFacts({}, "ray::IDLE")).expected
    assert not ray.name(ProcFacts({}, "/usr/bin/raylet --x")).expected


def _decide(
    rules: KindRules | None,
    cmdline: str,
    files: tuple[str, ...] = (),
    sources: list[str] | None = None,
) -> Verdict:
    if sources is None:
        sources = []
    return decide_rank(
        [parse_rank_source(s) for s in sources],
        rules,
        ProcFacts({}, cmdline, files),
        local_ranks=IDENTITY,
        device_ranks=IDENTITY,
    )


def test_the_device_wins_over_a_title_and_says_which_rule_disagreed() -> None:
    rules = rules_for("vllm", [*V, "-tp", "4"], {})
    agreed = _decide(rules, "VLLM::Worker_TP1", ("/dev/nvidiactl", "/dev/nvidia1"))
    assert (agreed.rank, agreed.disagreed) == (1, False)
    v = _decide(rules, "VLLM::Worker_TP1", ("/dev/nvidia3",))
    assert (v.rank, v.title_rank, v.disagreed) == (3, 1, True)
    assert v.rule.startswith("VLLM::Worker")
    # Several device nodes open (CUDA may open them all): the title decides.
    assert _decide(rules, "VLLM::Worker_TP2", ("/dev/nvidia0", "/dev/nvidia1")).rank == 2
    # A worker before its title is final: named by its device alone.
    assert _decide(rules, "VLLM::Worker", ("/dev/nvidia2",)).rank == 2
    # Not a process the kind expects as a rank: a device does not make it one.
    assert _decide(rules, "VLLM::EngineCore", ("/dev/nvidia0",)).rank is None
    # rank_from overrides the kind, and the device still wins over it.
    v = _decide(rules, "VLLM::Worker_TP1", ("/dev/nvidia2",), [r"cmdline:TP(\d+)"])
    assert (v.rank, v.title_rank) == (2, 1)
    ray = rules_for("ray", ["ray", "start"], {})
    assert _decide(ray, "ray::Actor", ("/dev/nvidia1",)).rank == 1
    assert _decide(ray, "ray::Actor").rank is None
    assert _decide(None, "anything").expected  # without a kind every process counts


def test_waiting_warnings() -> None:
    seen = [
        Verdict(None, True, "rule", "VLLM::Worker"),
        Verdict(None, False, "rule", "VLLM::EngineCore"),
        Verdict(None, True, "rule", "VLLM::Worker"),
        Verdict(None, False, "rule", "python"),
    ]
    common: dict[str, Any] = {
        "threshold_s": 30.0,
        "waiting": {1, 0},
        "warned": set(),
        "seen": seen,
        "titled": {"VLLM::EngineCore"},
        "rule": "rule",
    }
    assert waiting_warnings(waited_s=29.9, **common) == []
    got = waiting_warnings(waited_s=30.0, **common)
    assert [w.rank for w in got] == [0, 1]
    assert got[0].titles == ("VLLM::Worker", "VLLM::EngineCore")
    assert [w.rank for w in waiting_warnings(waited_s=31, **{**common, "warned": {0}})] == [1]
    # Nothing the kind expects and nothing titled: silence is right.
    quiet = {**common, "seen": [seen[3]], "titled": set()}
    assert waiting_warnings(waited_s=99, **quiet) == []


ENGINE_WORKERS = {"spawned_by": "engine"}


def test_config_engine_kind() -> None:
    cfg = parse_config({"engine": {"command": ["vllm", "serve", "m"]}, "workers": ENGINE_WORKERS})
    assert cfg.engine is not None and cfg.engine.kind == "vllm"
    assert cfg.workers.rank_from == () and cfg.workers.waiting_warning_s == 30.0
    cfg = parse_config(
        {
            "engine": {"command": ["./my-server"], "kind": "sglang"},
            "workers": {**ENGINE_WORKERS, "waiting_warning_s": 5},
        }
    )
    assert cfg.engine is not None and cfg.engine.kind == "sglang"
    assert cfg.workers.waiting_warning_s == 5.0


@pytest.mark.parametrize(
    ("engine", "workers", "message"),
    [
        ({"command": ["./e"]}, ENGINE_WORKERS, "workers.rank_from: is required"),
        ({"command": ["./e"], "kind": "custom"}, ENGINE_WORKERS, "engine.kind is custom"),
        ({"command": ["e"], "kind": "tgi"}, ENGINE_WORKERS, "engine.kind: must be one of"),
        (
            {"command": ["vllm", "serve", "-tp", "x"]},
            ENGINE_WORKERS,
            "engine.command: -tp",
        ),
        (
            {"command": ["vllm", "serve"]},
            {**ENGINE_WORKERS, "waiting_warning_s": 0},
            "workers.waiting_warning_s: must be > 0",
        ),
    ],
)
def test_config_engine_kind_errors(
    engine: dict[str, Any], workers: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"engine": engine, "workers": workers}, "c.toml")
    assert message in str(err.value)
