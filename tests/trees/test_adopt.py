"""Adoption of engine-spawned workers (docs/contracts.md §6): the sources as tables, the config's
errors, /proc facts from a fixture tree, and a real daemon adopting real processes.

The real engine below is a small launcher shaped like torchrun: it starts one
worker per rank in a session of its own (`start_new_session=True`) and starts
a new one when one exits. The workers are named by their environment
(`env:LOCAL_RANK`) or by a process title set with the real `setproctitle`
(`cmdline:VLLM::Worker_TP(\\d+)`, as vLLM titles its workers).
No /dev/nvidia* exists here, so `device` is tested on a fixture /proc tree
(fd links to /dev/nvidia1 and /dev/dri/renderD129), not on a real open.
"""

from __future__ import annotations

import os
import signal
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import parse_config
from supervisor.engines.rank_source import ProcFacts, RankSource, parse_rank_source, resolve_rank
from supervisor.errors import ConfigError
from supervisor.hostfs import HostFS
from supervisor.listen import parse_listen
from supervisor.serve.status import http_request
from supervisor.trees.adopt import read_proc_facts
from tests.support.children import thread_cpus
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

LOCAL = {0: 0, 1: 1}  # local rank -> rank
DEVICES = {0: 0, 1: 1}  # device index -> rank


def facts(
    env: dict[str, str] | None = None, cmdline: str = "", files: tuple[str, ...] = ()
) -> ProcFacts:
    return ProcFacts(env or {}, cmdline, files)


@pytest.mark.parametrize(
    ("sources", "proc", "rank"),
    [
        (["env:LOCAL_RANK"], facts({"LOCAL_RANK": "1"}), 1),
        (["env:LOCAL_RANK"], facts({"LOCAL_RANK": " 0\n"}), 0),
        (["env:LOCAL_RANK"], facts({"LOCAL_RANK": "x"}), None),
        (["env:LOCAL_RANK"], facts({"LOCAL_RANK": "-1"}), None),
        (["env:LOCAL_RANK"], facts({"LOCAL_RANK": "7"}), None),  # no such rank planned
        (["env:LOCAL_RANK"], facts({}), None),
        ([r"cmdline:VLLM::Worker_TP(\d+)"], facts(cmdline="VLLM::Worker_TP1"), 1),
        ([r"cmdline:VLLM::Worker_TP(\d+)"], facts(cmdline="VLLM::Worker_PP0_TP1 x"), None),
        ([r"cmdline:VLLM::Worker(?:_PP\d+)?_TP(\d+)"], facts(cmdline="VLLM::Worker_PP0_TP1"), 1),
        ([r"cmdline:sglang::scheduler_TP(\d+)"], facts(cmdline="sglang::scheduler_TP0"), 0),
        ([r"cmdline:--local-rank (\d+)"], facts(cmdline="python w.py --local-rank 1"), 1),
        (["device"], facts(files=("/dev/nvidiactl", "/dev/nvidia1", "/dev/nvidia-uvm")), 1),
        (["device"], facts(files=("/dev/dri/renderD128",)), 0),
        (["device"], facts(files=("/dev/davinci1",)), 1),
        (["device"], facts(files=("/dev/nvidia0", "/dev/nvidia1")), None),  # ambiguous
        (["device"], facts(files=("/dev/dri/card0",)), None),
        # In order: the first source that names a rank wins, the rest are fallbacks.
        (["env:LOCAL_RANK", "device"], facts({"LOCAL_RANK": "0"}, files=("/dev/nvidia1",)), 0),
        (["env:LOCAL_RANK", "device"], facts({}, files=("/dev/nvidia1",)), 1),
        (
            [r"cmdline:VLLM::Worker_TP(\d+)", "env:LOCAL_RANK"],
            facts({"LOCAL_RANK": "0"}, cmdline="VLLM::EngineCore"),
            0,
        ),
    ],
)
def test_resolve_rank(sources: list[str], proc: ProcFacts, rank: int | None) -> None:
    parsed = [parse_rank_source(s) for s in sources]
    assert resolve_rank(parsed, proc, local_ranks=LOCAL, device_ranks=DEVICES) == rank


def test_resolve_rank_maps_local_ranks_and_devices_through_the_plan() -> None:
    sources = [parse_rank_source("env:LOCAL_RANK"), parse_rank_source("device")]
    # Rank 3 drives local rank 0 and device 6 (a visibility list in another order).
    got = resolve_rank(sources, facts({"LOCAL_RANK": "0"}), local_ranks={0: 3}, device_ranks={})
    assert got == 3
    got = resolve_rank(sources, facts(files=("/dev/nvidia6",)), local_ranks={}, device_ranks={6: 3})
    assert got == 3


WORKERS = {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]}


@pytest.mark.parametrize(
    ("workers", "engine", "message"),
    [
        ({"spawned_by": "engine"}, True, "workers.rank_from: is required"),
        ({"spawned_by": "engine", "rank_from": []}, True, "workers.rank_from: must name"),
        ({"spawned_by": "me", "rank_from": ["device"]}, True, "workers.spawned_by: must be one of"),
        ({**WORKERS, "command": ["w"]}, True, "workers.command: give either command or"),
        ({**WORKERS, "rank_from": ["env:"]}, True, "workers.rank_from: item 0: env:NAME needs"),
        ({**WORKERS, "rank_from": ["cmdline:("]}, True, "item 0: 'cmdline:(': not a regular"),
        (
            {**WORKERS, "rank_from": ["device", "cmdline:TP"]},
            True,
            "item 1: 'cmdline:TP': the regex",
        ),
        ({**WORKERS, "rank_from": ["gpu"]}, True, "expected env:NAME, cmdline:REGEX or device"),
        ({**WORKERS, "rank_from": "env:X"}, True, "workers.rank_from: expected a list"),
        ({**WORKERS, "rank": 1}, True, "workers.rank: unknown key"),
        (WORKERS, False, 'workers.spawned_by: "engine" needs an [engine]'),
    ],
)
def test_config_errors_name_the_key(workers: dict[str, Any], engine: bool, message: str) -> None:
    doc: dict[str, Any] = {"workers": workers}
    if engine:
        doc["engine"] = {"command": ["e"]}
    with pytest.raises(ConfigError) as err:
        parse_config(doc, "c.toml")
    assert message in str(err.value)
    assert str(err.value).startswith("c.toml: ")


def test_config_adopted_workers() -> None:
    cfg = parse_config({"engine": {"command": ["e"]}, "workers": WORKERS})
    assert cfg.workers.spawned_by == "engine"
    assert cfg.workers.command == ()
    # Parsed once, at load time: the daemon hands these very sources to the adopter.
    assert cfg.workers.rank_from == (RankSource("env", name="LOCAL_RANK"),)
    assert [str(s) for s in cfg.workers.rank_from] == ["env:LOCAL_RANK"]
    sources = ["device", r"cmdline:TP(\d+)"]
    cfg = parse_config({"engine": {"command": ["e"]}, "workers": {**WORKERS, "rank_from": sources}})
    assert [s.kind for s in cfg.workers.rank_from] == ["device", "cmdline"]
    assert [str(s) for s in cfg.workers.rank_from] == sources


def test_read_proc_facts_from_a_fixture_tree(tmp_path: Path) -> None:
    proc = tmp_path / "proc/4242"
    (proc / "fd").mkdir(parents=True)
    (proc / "cmdline").write_bytes(b"VLLM::Worker_TP1\0\0\0\0")  # setproctitle pads with NULs
    (proc / "environ").write_bytes(b"A=1\0LOCAL_RANK=1\0BROKEN\0")
    for fd, target in (("0", "/dev/null"), ("7", "/dev/nvidia1"), ("8", "/dev/dri/renderD129")):
        (proc / "fd" / fd).symlink_to(target)
    (proc / "fd" / "9").symlink_to("/tmp/not-a-device")
    got = read_proc_facts(HostFS(str(tmp_path)), 4242, env_names=("A", "LOCAL_RANK"), want_fds=True)
    assert got is not None
    assert got.cmdline == "VLLM::Worker_TP1"
    assert got.environ == {"A": "1", "LOCAL_RANK": "1"}
    assert sorted(got.open_files) == ["/dev/dri/renderD129", "/dev/null", "/dev/nvidia1"]
    source = [parse_rank_source("device")]
    assert resolve_rank(source, got, local_ranks={}, device_ranks={1: 1}) == 1
    assert read_proc_facts(HostFS(str(tmp_path)), 4243, env_names=(), want_fds=True) is None


# -- a real daemon, a real launcher ----------------------------------------------------------

LAUNCHER = r"""
import os, subprocess, sys, time
marker, mode, ranks, ready, worker = sys.argv[1:6]
def start(rank):
    env = dict(os.environ)
    env.pop("LOCAL_RANK", None)
    if mode == "env":
        env["LOCAL_RANK"] = str(rank)
    argv = [sys.executable, worker, marker, mode, str(rank)]
    return subprocess.Popen(argv, env=env, start_new_session=True)  # as torchrun does
procs = {r: start(r) for r in range(int(ranks))}
# A helper no source names (no LOCAL_RANK, no title): it stays the engine's.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", marker, "helper"])
open(ready, "w").close()
while True:
    for r, p in list(procs.items()):
        if p.poll() is not None:
            procs[r] = start(r)
    time.sleep(0.05)
"""

WORKER = r"""
import sys, threading, time
marker, mode, rank = sys.argv[1:4]
if mode == "cmdline":
    import setproctitle
    setproctitle.setproctitle(f"VLLM::Worker_TP{rank}")
for i in range(2):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
time.sleep(3600)
"""


def adopt_config(tmp_path: Path, marker: str, mode: str) -> Path:
    launcher, worker = tmp_path / "launcher.py", tmp_path / "worker.py"
    launcher.write_text(LAUNCHER)
    worker.write_text(WORKER)
    ready = tmp_path / "engine.ready"
    source = "env:LOCAL_RANK" if mode == "env" else r"cmdline:VLLM::Worker_TP(\d+)"
    doc: dict[str, Any] = {
        "cpu_ranks": 2,
        "cgroup": "auto",
        "stop_timeout_s": 2,
        "engine": {
            "command": ["python", str(launcher), marker, mode, "2", str(ready), str(worker)]
        },
        "ready": {"file": str(ready), "timeout_s": 30},
        "workers": {"spawned_by": "engine", "rank_from": [source]},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
    }
    path = tmp_path / "adopt.toml"
    path.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 0.2\n")
    return path


def adopted(daemon: DaemonProcess, exclude: frozenset[int] = frozenset()) -> dict[str, Any] | None:
    doc = daemon.placement()
    if doc is None:
        return None
    for r in doc["ranks"]:
        if r["state"] != "running" or not r["adopted"] or r["pid"] in exclude:
            return None
    return doc


def cgroup_of(pid: int) -> str:
    """The process's v1 memory cgroup: v1 has no per-rank cpusets (supervisor.bind.cgroup)."""
    with open(f"/proc/{pid}/cgroup") as f:
        return next(line.split(":", 2)[2].strip() for line in f if ":memory:" in line)


def placed_as_planned(doc: dict[str, Any]) -> bool:
    for r in doc["ranks"]:
        threads = thread_cpus(r["pid"])
        want = ",".join(map(str, r["cpus"])) if len(r["cpus"]) == 1 else None
        if not threads or (want is not None and set(threads.values()) != {want}):
            return False
    return True


@pytest.mark.parametrize("mode", ["env", "cmdline"])
def test_a_real_engine_s_workers_are_adopted_and_replaced(tmp_path: Path, mode: str) -> None:
    marker = f"adopt-{uuid.uuid4().hex}"
    suffix = f"adopt-{mode}-{os.getpid()}"
    env = daemon_env(**{INSTANCE_ENV: suffix})
    with DaemonProcess(adopt_config(tmp_path, marker, mode), tmp_path / "d.log", env=env) as d:
        doc = poll(lambda: adopted(d), timeout_s=60, what="both ranks adopted")
        engine_pid = doc["engine"]["pid"]
        first = {r["rank"]: r["pid"] for r in doc["ranks"]}
        for r in doc["ranks"]:
            assert r["ppid"] == engine_pid
            assert r["cgroup"] is not None and r["cgroup"].endswith(f"/rank{r['rank']}")
            assert cgroup_of(r["pid"]).endswith(f"placement-supervisor-{suffix}/rank{r['rank']}")
        poll(lambda: placed_as_planned(d.placement() or {"ranks": []}), timeout_s=20)

        def engine_children() -> set[int]:
            return {c["pid"] for c in (d.placement() or doc)["engine"]["children"]}

        # Adopted workers are their ranks' roots now, no longer the engine's children.
        poll(lambda: not engine_children() & set(first.values()), timeout_s=10)
        if mode == "cmdline":
            with open(f"/proc/{first[1]}/cmdline", "rb") as f:
                assert f.read().startswith(b"VLLM::Worker_TP1")
        # A worker exits: the rank waits, then adopts the engine's next one.
        os.kill(first[0], signal.SIGKILL)
        doc = poll(
            lambda: adopted(d, exclude=frozenset({first[0]})),
            timeout_s=30,
            what="rank 0 re-adopted",
        )
        assert doc["ranks"][0]["pid"] != first[0]
        assert doc["ranks"][1]["pid"] == first[1]
        assert any("waiting" in e["message"] for e in d.events("state"))
        metrics = get_text(f"http://127.0.0.1:{d.port}/metrics")
        assert 'placement_adoptions_total{rank="0"} 2.0' in metrics
        assert 'placement_adoptions_total{rank="1"} 1.0' in metrics
        poll(
            lambda: (
                "placement_unnamed_processes_total 1.0"
                in get_text(f"http://127.0.0.1:{d.port}/metrics")
            ),
            timeout_s=30,  # 30 tree passes at 0.2 s
            what="the helper counted once as unnamed",
        )
        helper = [
            c for c in (d.placement() or doc)["engine"]["children"] if "helper" in c["cmdline"]
        ]
        assert len(helper) == 1 and helper[0]["ppid"] == engine_pid
        code = d.stop(timeout_s=30)
    assert code == 0, d.tail()


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text: str = resp.read().decode()
        return text


# Holds on after TERM until `release` exists next to its marker file.
HOLDING_WORKER = r"""
import os, signal, sys, time
marker, mode, rank = sys.argv[1:4]
out = os.environ["HOLD_DIR"]
termed = []
def on_term(signum, frame):
    termed.append(1)
    open(os.path.join(out, f"term-{rank}-{os.getpid()}"), "w").close()
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(out, f"up-{rank}-{os.getpid()}"), "w").close()
while not (termed and os.path.exists(os.path.join(out, "release"))):
    time.sleep(0.05)
"""


def test_an_adopted_rank_asked_to_restart_is_stopping_until_it_exits(tmp_path: Path) -> None:
    """POST /ranks/0/restart TERMs the adopted worker; the engine starts the next one.
    While the old one holds on after its TERM, rank 0 is `stopping` and not ready."""
    marker = f"adopt-{uuid.uuid4().hex}"
    config = adopt_config(tmp_path, marker, "env")
    (tmp_path / "worker.py").write_text(HOLDING_WORKER)
    hold = tmp_path / "hold"
    hold.mkdir()
    sock = tmp_path / "api.sock"
    config.write_text(
        config.read_text().replace("[drift]", f'[api]\nunix_socket = "{sock}"\n\n[drift]', 1)
    )
    env = daemon_env(**{INSTANCE_ENV: f"adopt-stop-{os.getpid()}", "HOLD_DIR": str(hold)})
    with DaemonProcess(config, tmp_path / "d.log", env=env) as d:
        doc = poll(lambda: adopted(d), timeout_s=60, what="both ranks adopted")
        old = doc["ranks"][0]["pid"]
        poll((hold / f"up-0-{old}").exists, timeout_s=30, what="rank 0's TERM handler")
        code, _, body = http_request(parse_listen(f"unix:{sock}"), "POST", "/ranks/0/restart")
        assert code == 200, body
        poll((hold / f"term-0-{old}").exists, timeout_s=30, what="rank 0's TERM")
        now = d.placement()
        assert now is not None and now["ranks"][0]["state"] == "stopping", now["ranks"][0]
        assert "0: stopping" in now["supervisor"]["not_ready"]
        code, _, body = http_request(parse_listen(f"127.0.0.1:{d.port}"), "GET", "/readyz")
        assert code == 503, body
        (hold / "release").touch()
        doc = poll(
            lambda: adopted(d, exclude=frozenset({old})), timeout_s=30, what="rank 0 re-adopted"
        )
        assert doc["supervisor"]["ready"], doc["supervisor"]["not_ready"]
        code = d.stop(timeout_s=30)
    assert code == 0, d.tail()
