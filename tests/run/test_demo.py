"""The demo programs and the shipped configs.

The demo engine and worker run as real processes (their thread names,
affinity and memory are read from /proc); every config under configs/ loads,
and each host-kind example plans on the fixture host of that kind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import discovery_options, load_config
from supervisor.demo.worker import parse_numa_maps
from supervisor.examples import hosts
from supervisor.hostfs import HostFS
from supervisor.plan.planner import plan
from supervisor.run.spec import build_specs
from supervisor.topology.discover import read_topology
from supervisor.worker import SLOT_ENV, slot_env_value
from tests.support.daemon_support import (
    free_port,
)
from tests.support.poll import poll

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
FS = HostFS("/")


def thread_names(pid: int) -> dict[int, str]:
    out = {}
    for tid in FS.listdir(f"proc/{pid}/task"):
        comm = FS.read_optional(f"proc/{pid}/task/{tid}/comm")
        if comm is not None:
            out[int(tid)] = comm.strip()
    return out


def test_configs_demo_is_the_packaged_demo() -> None:
    link = CONFIGS / "demo.toml"
    assert link.is_symlink()
    assert os.readlink(link) == "../supervisor/demo/demo.toml"
    assert link.resolve() == (REPO / "supervisor/demo/demo.toml").resolve()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    load_config(str(path))


def test_demo_config_is_what_the_readme_promises() -> None:
    config = load_config(str(CONFIGS / "demo.toml"))
    assert config.accelerator == "auto" and config.cpu_ranks == 2
    assert str(config.api.listen) == "127.0.0.1:9477"
    roles = {(t.role, t.process, t.pattern) for t in config.threads}
    assert ("so_compiler", "engine", "so-compile-*") in roles
    assert ("comm", "workers", "comm*") in roles
    assert ("release", "workers", "release*") in roles
    assert config.ready is not None and config.ready.tcp == "127.0.0.1:9478"


@pytest.mark.parametrize(
    ("config_name", "host", "var", "ranks"),
    [
        ("nvidia-8gpu-vllm.toml", hosts.dgx_h100, "CUDA_VISIBLE_DEVICES", 8),
        ("ascend-16npu.toml", hosts.ascend_a3, "ASCEND_RT_VISIBLE_DEVICES", 16),
        ("amd-mi300x.toml", hosts.mi300x, "HIP_VISIBLE_DEVICES", 8),
    ],
)
def test_host_kind_examples_plan_on_their_kind_of_host(
    tmp_path: Path, config_name: str, host: object, var: str, ranks: int
) -> None:
    config = load_config(str(CONFIGS / config_name))
    root = host(tmp_path)  # type: ignore[operator]
    topology = read_topology(HostFS(str(root)), discovery_options(config, {}))
    placement = plan(topology, config.placement)
    assert len(placement.ranks) == ranks
    assert not placement.shared
    specs = build_specs(config, placement, {"PATH": "/usr/bin"})
    workers = [s for s in specs if s.key != "engine"]
    assert [s.env[var] for s in workers] == [str(r.device.index) for r in placement.ranks]
    assert len({s.env[var] for s in workers}) == ranks  # each rank its own device


def test_parse_numa_maps_policy_and_pages() -> None:
    text = (
        "55d0 bind:1 file=/usr/bin/python3 mapped=2 N1=2 kernelpagesize_kB=4\n"
        "55e0 bind:1 heap anon=300 dirty=300 N1=300 kernelpagesize_kB=4\n"
        "7f00 bind:1 anon=1024 dirty=1024 N0=24 N1=1000 kernelpagesize_kB=4\n"
    )
    policy, pages = parse_numa_maps(text)
    assert policy == "bind:1"
    assert pages == {0: 24, 1: 1300}


def test_demo_engine_names_and_binds_its_compiler_pool_and_listens() -> None:
    port = free_port()
    slot = slot_env_value("engine", {"cpus": [0, 1], "mems": [0], "roles": {"so_compiler": [0]}})
    engine = subprocess.Popen(
        [sys.executable, "-m", "supervisor.demo.engine", "--port", str(port)],
        env=dict(os.environ, **{SLOT_ENV: slot}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert engine.stdout is not None
        first = engine.stdout.readline().decode()
        assert first.startswith("placement engine pid=")

        def pool() -> dict[int, str]:
            return {t: n for t, n in thread_names(engine.pid).items() if n.startswith("so-compile")}

        threads = poll(pool)
        assert sorted(threads.values()) == ["so-compile-0"]  # one planned so_compiler CPU
        for tid in threads:
            assert os.sched_getaffinity(tid) == {0}
        # The pool starts before the socket listens: wait for the engine to say so.
        assert engine.stdout.readline().decode().startswith("engine listening ")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            assert conn.recv(16) == b"ok\n"
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    assert engine.returncode == 0


def test_demo_worker_reports_placement_runs_named_threads_and_fills_memory() -> None:
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "supervisor.demo.worker",
            "--rank",
            "3",
            "--mem-cap-mib",
            "32",
            "--step-mib",
            "8",
            "--interval-s",
            "0.05",
            "--report-interval-s",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert worker.stdout is not None
        first = worker.stdout.readline().decode()
        assert first.startswith(f"placement rank=3 pid={worker.pid} cpus=")
        assert " policy=default " in first  # nobody bound this one
        names = poll(lambda: {"comm", "release"} <= set(thread_names(worker.pid).values()))
        assert names
        # Reports keep coming; one soon shows the cap reached.
        stdout = worker.stdout

        def capped_report() -> str | None:
            text = stdout.readline().decode()
            return text if "allocated=32MiB" in text else None

        line = poll(capped_report)
        assert f"pid={worker.pid}" in line
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    assert worker.returncode == 0
