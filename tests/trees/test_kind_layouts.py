"""Every parallel layout of vLLM and SGLang, named by the engine's kind alone (DESIGN 3.6).

A real daemon runs a stand-in engine (tests/support/fake_engine/layouts.py)
that builds the engine's process tree with multiprocessing spawn and titles
it with the real setproctitle, exactly as the engine's sources do; the config
says only `spawned_by = "engine"` (no rank_from): the kind is recognised from
the command (`python -m vllm.entrypoints.openai.api_server`, `python -m
sglang.launch_server`). Each stand-in process records the device it drives,
so the test knows which process must be which rank. For every layout: the
right process is each rank, every one of its threads on the rank's CPUs, in
the rank's cgroup; every other process stays on the engine's slot.
"""

from __future__ import annotations

import os
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from supervisor.cpulist import format_cpulist, parse_cpulist
from tests.support.children import thread_cpus
from tests.support.daemon_support import (
    INSTANCE_ENV,
    REPO,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.fake_engine.layouts import STALL_ENV
from tests.support.fake_engine.shims import SGLANG_MODULE, VLLM_MODULE, records, write_shim
from tests.support.poll import poll


def layout_config(
    tmp_path: Path,
    module: str,
    flags: list[str],
    ranks: int,
    *,
    env: dict[str, str] | None = None,
    workers: dict[str, Any] | None = None,
    rank_roles: dict[str, int] | None = None,
) -> tuple[Path, Path]:
    shims = tmp_path / "shims"
    write_shim(shims, VLLM_MODULE, "vllm_main")
    write_shim(shims, SGLANG_MODULE, "sglang_main")
    record = tmp_path / "record"
    record.mkdir()
    doc: dict[str, Any] = {
        "cpu_ranks": ranks,
        "cgroup": "auto",
        "stop_timeout_s": 2,
        "engine": {
            "command": [
                "python",
                "-m",
                module,
                "--model",
                "m",
                *flags,
                "--record-dir",
                str(record),
            ],
            "env": {"PYTHONPATH": f"{shims}{os.pathsep}{REPO}", **(env or {})},
        },
        "workers": {"spawned_by": "engine", **(workers or {})},
        "placement": {"rank_roles": rank_roles or {}, "on_shortage": "share"},
    }
    path = tmp_path / "layout.toml"
    path.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 0.2\n")
    return path, record


def cgroup_of(pid: int) -> str:
    """The process's v1 memory cgroup: v1 has no per-rank cpusets (supervisor.bind.cgroup)."""
    with open(f"/proc/{pid}/cgroup") as f:
        return next(line.split(":", 2)[2].strip() for line in f if ":memory:" in line)


def all_adopted(d: DaemonProcess, ranks: int, record: Path) -> dict[str, Any] | None:
    doc = d.placement()
    if doc is None or len(records(record)) < ranks:
        return None
    if all(r["state"] == "running" and r.get("adopted") for r in doc["ranks"]):
        return doc
    return None


def threads_on(pid: int, cpus: list[int]) -> bool:
    got = thread_cpus(pid)
    return bool(got) and set(got.values()) == {format_cpulist(cpus)}


def threads_within(pid: int, cpus: list[int]) -> bool:
    """Every thread's CPUs inside `cpus` (the engine's threads sit on its role CPUs)."""
    got = thread_cpus(pid)
    return bool(got) and all(set(parse_cpulist(v)) <= set(cpus) for v in got.values())


LAYOUTS = [
    pytest.param(VLLM_MODULE, ["--tensor-parallel-size", "2"], 2, {}, id="vllm-tp2"),
    pytest.param(VLLM_MODULE, ["-tp", "2", "-pp", "2"], 4, {}, id="vllm-pp2-tp2"),
    pytest.param(
        VLLM_MODULE,
        ["-tp", "2", "-dp", "2"],
        4,
        {"VLLM_PROCESS_NAME_PREFIX": "LLM"},
        id="vllm-dp2-tp2-prefix",
    ),
    pytest.param(VLLM_MODULE, ["--data-parallel-size", "2"], 2, {}, id="vllm-dp2-tp1"),
    pytest.param(VLLM_MODULE, [], 1, {}, id="vllm-tp1"),
    pytest.param(SGLANG_MODULE, ["--tp", "2"], 2, {}, id="sglang-tp2"),
    pytest.param(SGLANG_MODULE, ["--tp-size", "2", "--dp-size", "2"], 4, {}, id="sglang-dp2-tp2"),
    pytest.param(SGLANG_MODULE, [], 1, {}, id="sglang-tp1"),
    # Node 1 of 2: vLLM's DP ranks 2-3 run here as local DP ranks 0-1
    # (devices 0-3); SGLang's second PP stage runs here from GPU 0.
    pytest.param(
        VLLM_MODULE,
        [
            "-tp",
            "2",
            "-dp",
            "4",
            "-dpl",
            "2",
            "-dpr",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--headless",
        ],
        4,
        {},
        id="vllm-node1-dp4-tp2",
    ),
    pytest.param(
        SGLANG_MODULE,
        ["--tp", "2", "--pp", "2", "--nnodes", "2", "--node-rank", "1"],
        2,
        {},
        id="sglang-node1-pp2-tp2",
    ),
]


@pytest.mark.parametrize(("module", "flags", "ranks", "env"), LAYOUTS)
def test_each_layout_s_ranks_are_the_processes_that_drive_the_devices(
    tmp_path: Path, module: str, flags: list[str], ranks: int, env: dict[str, str]
) -> None:
    config, record = layout_config(tmp_path, module, flags, ranks, env=env)
    suffix = f"kinds-{uuid.uuid4().hex[:8]}"
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env(**{INSTANCE_ENV: suffix})) as d:
        doc = poll(lambda: all_adopted(d, ranks, record), timeout_s=90, what="every rank adopted")
        drives = records(record)
        for r in doc["ranks"]:
            # The process that drives device r (the r-th visible) is rank r.
            assert r["pid"] == drives[r["rank"]], (r, drives, d.tail())
            assert cgroup_of(r["pid"]).endswith(f"/rank{r['rank']}")

        def placed() -> bool:
            now = d.placement()
            return now is not None and all(threads_on(r["pid"], r["cpus"]) for r in now["ranks"])

        poll(placed, timeout_s=20, what="every rank thread on its rank's CPUs")

        def engine_with_children() -> dict[str, Any] | None:
            now = d.placement()
            return now["engine"] if now is not None and now["engine"]["children"] else None

        # The tree keeper publishes the trees at its pass, every check interval
        # (1 s here): the ranks may be bound before the first pass that follows
        # the engine's forks (seen once on 3 workers: vllm-tp1 bound, no child yet).
        engine = poll(engine_with_children, 10, what="the engine's other processes listed")
        children = engine["children"]
        assert children, "the engine's other processes are listed"
        rank_pids = {r["pid"] for r in doc["ranks"]}
        for child in children:
            assert child["pid"] not in rank_pids
            assert cgroup_of(child["pid"]).endswith("/engine"), child
            assert threads_within(child["pid"], engine["cpus"]), child
        assert not d.events("rank_conflict")
        # An adopted worker is never bound to the engine's CPUs (outside its
        # rank's cpuset: EINVAL), however its adoption and a check pass interleave.
        invalid = [e for e in d.events("bind_failed") if e["fields"].get("reason") == "invalid"]
        assert invalid == [], invalid
        code = d.stop(timeout_s=30)
    assert code == 0, d.tail()
    for pid in drives.values():
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def metric(d: DaemonProcess, line: str) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=5) as resp:
        return line in resp.read().decode()


def test_a_rank_that_waits_while_titles_do_not_match_warns_once(tmp_path: Path) -> None:
    """Silence is a bug: vLLM workers stuck before device init keep the title
    `VLLM::Worker`; each rank warns once, naming the titles and the rule."""
    config, _ = layout_config(
        tmp_path,
        VLLM_MODULE,
        ["-tp", "2"],
        2,
        env={STALL_ENV: "1"},
        workers={"waiting_warning_s": 1},
    )
    suffix = f"kinds-{uuid.uuid4().hex[:8]}"
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env(**{INSTANCE_ENV: suffix})) as d:
        warned = poll(
            lambda: len(d.events("rank_waiting")) == 2 and d.events("rank_waiting"),
            timeout_s=60,
            what="both ranks warned",
        )
        assert {e["rank"] for e in warned} == {"0", "1"}
        for e in warned:
            assert "VLLM::Worker" in e["fields"]["titles"].split(",")
            assert "VLLM::EngineCore" not in e["fields"]["titles"]  # vLLM's own
            assert e["fields"]["rule"].startswith("VLLM::Worker[_DP<d>]")
        log = d.tail(20000)
        assert log.count("rank waiting") == 2 and "WARNING" in log
        assert metric(d, 'placement_rank_waiting_warnings_total{rank="0"} 1.0')
        # Only the two workers count as unnamed: not the engine core, the API
        # server or multiprocessing's resource tracker (30 passes at 0.2 s).
        poll(
            lambda: metric(d, "placement_unnamed_processes_total 2.0"),
            timeout_s=30,
            what="the stuck workers counted",
        )
        assert len(d.events("rank_waiting")) == 2  # once each, not each pass
        code = d.stop(timeout_s=30)
    assert code == 0, d.tail()


def test_an_sglang_scheduler_s_grammar_pool_follows_its_rank_s_slot(tmp_path: Path) -> None:
    """SGLang compiles grammars in each scheduler: the pool (created after the
    title, when the scheduler is already adopted) is capped at the rank's
    so_compiler CPUs and its threads sit there, not on the engine's slot."""
    config, record = layout_config(
        tmp_path, SGLANG_MODULE, ["--tp", "2"], 2, rank_roles={"so_compiler": 1}
    )
    text = config.read_text() + (
        '[threads.so_compiler]\nprocess = "engine"\nexecutors = ["sglang.srt.constrained"]\n'
        '[threads.rank_so_compiler]\nprocess = "workers"\nrole = "so_compiler"\n'
        'pattern = "so_compiler-[0-9]*"\n'
    )
    config.write_text(text)
    suffix = f"kinds-{uuid.uuid4().hex[:8]}"
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env(**{INSTANCE_ENV: suffix})) as d:
        doc = poll(lambda: all_adopted(d, 2, record), timeout_s=90, what="both schedulers")
        for r in doc["ranks"]:
            pid = r["pid"]
            # On this 2-CPU box the plan merges so_compiler into main (as Slot.role_cpus).
            want = r["roles"].get("so_compiler") or r["roles"]["main"]
            pool = poll(
                lambda pid=pid: (
                    (record / f"pool-{pid}").exists() and (record / f"pool-{pid}").read_text()
                ),
                timeout_s=30,
                what="the pool made",
            )
            assert int(pool) == len(want), (r, d.tail())

            def pool_threads(pid: int = pid) -> dict[int, str]:
                names = thread_names(pid)
                cpus = thread_cpus(pid)
                return {t: cpus[t] for t, n in names.items() if n.startswith("so_compiler-")}

            poll(
                lambda pt=pool_threads, want=want: (
                    len(pt()) == len(want) and set(pt().values()) == {format_cpulist(want)}
                ),
                timeout_s=20,
                what="the pool's threads on the rank's so_compiler CPUs",
            )
        code = d.stop(timeout_s=30)
    assert code == 0, d.tail()


def thread_names(pid: int) -> dict[int, str]:
    out: dict[int, str] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:
            continue
    return out
