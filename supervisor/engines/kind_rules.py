"""Each engine kind's own rules for which process is which rank (pure, no I/O).

With `[workers] spawned_by = "engine"` and no `rank_from`, the kind names
the ranks: from the process titles the engine sets (vLLM, SGLang), its
environment (torchrun's LOCAL_RANK) or the device it holds open (Ray).
A `Naming` gives the local rank (the ordinal among the engine's visible
devices, as LOCAL_RANK is), the rule that gave it, and whether the kind
expects the process to be a rank at all (what the waiting warning and
`placement_unnamed_processes_total` count).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from supervisor.engines.engine_kind import (
    ResolvedKind,
    SglangLayout,
    VllmLayout,
    sglang_layout,
    vllm_layout,
)
from supervisor.engines.rank_source import ProcFacts

# vllm/envs.py: VLLM_PROCESS_NAME_PREFIX, default "VLLM"; set_process_title
# (vllm/utils/system_utils.py) titles "<prefix>::<name>[_<suffix>]".
VLLM_PREFIX_ENV = "VLLM_PROCESS_NAME_PREFIX"
# The engine environment variables `rules_for` reads (attach mode reads them from
# the found engine's /proc/<pid>/environ).
ENGINE_ENV_NAMES = frozenset({VLLM_PREFIX_ENV})
VLLM_DEFAULT_PREFIX = "VLLM"

# `_DP0_PP1_TP2`, `_ATTN_CP0`: a parallel dimension and the process's index in it.
_PARTS = re.compile(r"_([A-Z]+(?:_[A-Z]+)*)(\d+)")


def title_parts(suffix: str) -> dict[str, int] | None:
    """{"DP": 0, "TP": 2} of a title's suffix "_DP0_TP2" (None: not such a suffix)."""
    parts: dict[str, int] = {}
    pos = 0
    for m in _PARTS.finditer(suffix):
        if m.start() != pos:
            return None
        parts[m.group(1)] = int(m.group(2))
        pos = m.end()
    return parts if pos == len(suffix) else None


def title_of(cmdline: str) -> str:
    """The first word of a command line: the title setproctitle set (no spaces in these)."""
    return cmdline.split(" ", 1)[0]


@dataclass(frozen=True, slots=True)
class Naming:
    """What a kind's rules say of one process."""

    local_rank: int | None  # the ordinal among the engine's visible devices
    rule: str  # the rule that named it, or that expected a rank and did not match
    expected: bool  # the kind expects this process to be a rank
    # One of the engine's own processes that is never a rank (vLLM's engine
    # core with workers, SGLang's detokenizer): its title says nothing amiss.
    known: bool = False


NOT_A_RANK = Naming(None, "", False)
ENGINE_OWN = Naming(None, "", False, known=True)


@dataclass(frozen=True, slots=True)
class KindRules:
    """The rules of one engine kind, with the layout read from its command."""

    kind: ResolvedKind
    vllm: VllmLayout | None = None
    sglang: SglangLayout | None = None
    vllm_prefix: str = VLLM_DEFAULT_PREFIX  # the engine's configured environment's value
    env_names: frozenset[str] = field(default_factory=frozenset)

    @property
    def want_fds(self) -> bool:
        """Read each process's open device nodes: the device wins over a title (DESIGN 3.6)."""
        return self.kind != "custom"

    def describe(self) -> str:
        """The rule, as the waiting warning names it."""
        if self.kind == "vllm" and self.vllm is not None:
            v = self.vllm
            core = f" or {self.vllm_prefix}::EngineCore[_DP<d>]" if v.core_drives_device else ""
            return (
                f"{self.vllm_prefix}::Worker[_DP<d>][_PP<p>][_PCP<c>][_TP<t>]...{core} "
                f"(tp={v.tp} pp={v.pp} pcp={v.pcp} dp={v.dp} dp_local={v.dp_local} "
                f"dp_start={v.dp_start})"
            )
        if self.kind == "sglang" and self.sglang is not None:
            s = self.sglang
            return (
                f"sglang::scheduler[_DP<d>][_PP<p>][_TP<t>][_EP<e>] (tp={s.tp} pp={s.pp} "
                f"dp={s.dp} base_gpu_id={s.base_gpu_id} gpu_id_step={s.gpu_id_step})"
            )
        if self.kind == "torchrun":
            return "env:LOCAL_RANK"
        if self.kind == "ray":
            return "device (the accelerator a ray:: actor holds open)"
        return "none"

    def name(self, facts: ProcFacts) -> Naming:
        """What the kind's rules say of `facts`' process."""
        if self.kind == "vllm" and self.vllm is not None:
            prefix = facts.environ.get(VLLM_PREFIX_ENV, self.vllm_prefix)
            return name_vllm(self.vllm, prefix, title_of(facts.cmdline))
        if self.kind == "sglang" and self.sglang is not None:
            return name_sglang(self.sglang, title_of(facts.cmdline))
        if self.kind == "torchrun":
            # torch/distributed/elastic/agent/server/local_elastic_agent.py
            # _start_workers: each worker's LOCAL_RANK.
            text = facts.environ.get("LOCAL_RANK")
            if text is None:
                return NOT_A_RANK
            text = text.strip()
            return Naming(int(text) if text.isdigit() else None, "env:LOCAL_RANK", True)
        if self.kind == "ray":
            return name_ray(title_of(facts.cmdline))
        return NOT_A_RANK

    def titled(self, cmdline: str) -> bool:
        """A process that set a title: what the waiting warning reports when no rule expected it."""
        return "::" in title_of(cmdline)


def name_vllm(layout: VllmLayout, prefix: str, title: str) -> Naming:
    """vLLM's processes (vllm/v1/executor/multiproc_executor.py WorkerProc
    setup_proc_title_and_log_prefix; vllm/v1/engine/core.py run_engine_core).

    A worker is titled `Worker` until its parallel groups exist (before device
    init), then `Worker` + `_DP<d>` (dp>1) + `_PP<p>` (pp>1) + `_PCP<c>` +
    `_TP<t>` (tp>1) + `_DCP<k>` + `_EP<e>` (DCP and EP split TP: no
    process of their own). The engine core is `EngineCore`, with DP
    `EngineCore_DP<d>` (older releases: `DPEngineCore_<d>`); it drives the
    device itself when TP x PP x PCP = 1. The API server is not a rank.
    """
    head = f"{prefix}::"
    if not title.startswith(head):
        return NOT_A_RANK
    name = title[len(head) :]
    worker_rule = f"{head}Worker[_DP<d>][_PP<p>][_TP<t>]"
    if name.startswith("Worker"):
        parts = title_parts(name[len("Worker") :])
        if parts is None:
            return NOT_A_RANK
        if not parts:
            # Before device init every worker is plain `Worker`: only the one
            # worker of a one-GPU, one-DP-rank engine is known by it.
            if layout.world == 1 and layout.dp_local == 1:
                return Naming(layout.local_device(layout.dp_start, 0, 0, 0), worker_rule, True)
            return Naming(None, worker_rule, True)
        local = layout.local_device(
            parts.get("DP", layout.dp_start),
            parts.get("PP", 0),
            parts.get("PCP", 0),
            parts.get("TP", 0),
        )
        return Naming(local, worker_rule, True)
    dp_rank: int | None = None
    if name == "EngineCore":
        dp_rank = layout.dp_start
    elif name.startswith("EngineCore_DP") and name[len("EngineCore_DP") :].isdigit():
        dp_rank = int(name[len("EngineCore_DP") :])
    elif name.startswith("DPEngineCore_") and name[len("DPEngineCore_") :].isdigit():
        dp_rank = int(name[len("DPEngineCore_") :])
    if dp_rank is None or not layout.core_drives_device:
        return ENGINE_OWN  # the API server, a DP coordinator, an engine core with workers
    core_rule = f"{head}EngineCore[_DP<d>] (tp x pp = 1)"
    return Naming(layout.local_device(dp_rank, 0, 0, 0), core_rule, True)


def name_sglang(layout: SglangLayout, title: str) -> Naming:
    """SGLang's processes (python/sglang/srt/managers/scheduler.py
    run_scheduler_process): `sglang::scheduler` + " DP<d>" (a DP rank) +
    " PP<p>" (pp>1) + " TP<t>" (tp>1) + " EP<e>" (ep>1), spaces as "_"; plain
    `sglang::scheduler` with tp=1. The detokenizer and the DP controller are
    not ranks."""
    head = "sglang::scheduler"
    if not title.startswith(head):
        # sglang::detokenizer, sglang::data_parallel_controller, ...
        return ENGINE_OWN if title.startswith("sglang::") else NOT_A_RANK
    parts = title_parts(title[len(head) :])
    if parts is None:
        return NOT_A_RANK
    rule = f"{head}[_DP<d>][_PP<p>][_TP<t>][_EP<e>]"
    local = layout.local_device(parts.get("DP", 0), parts.get("PP", 0), parts.get("TP", 0))
    return Naming(local, rule, True)


def name_ray(title: str) -> Naming:
    """A Ray actor is titled `ray::<Class>` (`ray::<Class>.<method>` while it
    runs one; python/ray/_private/worker.py); `ray::IDLE` is a pooled worker
    with no task. Only the device it holds open names its rank."""
    if title in ("ray::IDLE", "ray::IDLE_SPILL_WORKER"):
        return ENGINE_OWN
    if not title.startswith("ray::"):
        return NOT_A_RANK
    return Naming(None, "device", True)


def rules_for(kind: ResolvedKind, argv: Sequence[str], engine_env: Mapping[str, str]) -> KindRules:
    """The rules of `kind` for the engine command `argv` (ValueError: a flag is not an integer)."""
    if kind == "vllm":
        prefix = engine_env.get(VLLM_PREFIX_ENV, VLLM_DEFAULT_PREFIX)
        return KindRules(
            kind,
            vllm=vllm_layout(argv),
            vllm_prefix=prefix,
            env_names=frozenset({VLLM_PREFIX_ENV}),
        )
    if kind == "sglang":
        return KindRules(kind, sglang=sglang_layout(argv))
    if kind == "torchrun":
        return KindRules(kind, env_names=frozenset({"LOCAL_RANK"}))
    return KindRules(kind)
