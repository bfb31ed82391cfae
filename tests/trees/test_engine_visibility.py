"""Attach mode on a host of several engine services: the attached engine's own
visibility variables choose its devices (supervisor.trees.engine_visibility).

The engines are real processes with `CUDA_VISIBLE_DEVICES` in their environment,
found by a `match` target and read through the real /proc; the plan is made on
a fixture host of four GPUs (two nodes), as `run` makes it at start."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from supervisor.config import Config, parse_config
from supervisor.daemon.root import prepare
from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from supervisor.trees.attach import attach_env
from supervisor.trees.engine_visibility import engine_visibility, visibility_difference
from tests.support.poll import poll

GPUS = ("0000:1a:00.0", "0000:1b:00.0", "0000:9a:00.0", "0000:9b:00.0")
SLEEP = "import sys, time; time.sleep(600)"
CHROOTED = "import os, sys, time; os.chroot(sys.argv[1]); time.sleep(600)"


@contextmanager
def engine(env: dict[str, str], code: str = SLEEP, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env={"PATH": "/usr/bin", **env})
    try:
        # Until its exec: the forked child has the test's environment before it.
        poll(lambda: code in Path(f"/proc/{proc.pid}/cmdline").read_text(), 10, what="exec")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def fixture_host(tmp_path: Path) -> HostFS:
    builder = FakeHost(tmp_path).cpus(2, 4, 1).cgroup_v1("/", "0-7", "0-1")
    for i, bdf in enumerate(GPUS):
        builder = builder.nvidia_gpu(bdf, i // 2)
    return HostFS(str(builder.build()))


def attach_config(match: str) -> Config:
    return parse_config(
        {
            "engine": {"attach": {"match": match}, "kind": "vllm"},
            "placement": {"rank_roles": {}, "on_shortage": "share"},
        },
        "c.toml",
    )


def test_an_engine_s_own_variables_are_read_under_our_root_only(tmp_path: Path) -> None:
    with engine({"CUDA_VISIBLE_DEVICES": "2,3", "OTHER": "x"}) as proc:
        assert engine_visibility(HostFS("/"), proc.pid) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert engine_visibility(HostFS("/"), proc.pid) is None  # gone
    if os.geteuid() != 0:
        pytest.skip("chroot(2) needs root")
    (tmp_path / "root").mkdir()
    with engine({"CUDA_VISIBLE_DEVICES": "0"}, CHROOTED, str(tmp_path / "root")) as proc:
        # Another root (a container's): its indices count its own devices.
        chrooted = os.stat(tmp_path / "root").st_ino
        poll(lambda: os.stat(f"/proc/{proc.pid}/root").st_ino == chrooted, 10, what="chroot")
        assert engine_visibility(HostFS("/"), proc.pid) is None


def test_the_engine_s_variables_plan_its_devices_where_ours_set_none(tmp_path: Path) -> None:
    """Two services on one host, the second on GPUs 2 and 3 by its unit's
    CUDA_VISIBLE_DEVICES: its supervisor, with none of its own, plans those two
    (before: all four, the engine's LOCAL_RANK 0 taken for GPU 0)."""
    marker = f"vllm serve engine-vis-{uuid.uuid4().hex}"
    config = attach_config(marker)
    host = fixture_host(tmp_path)
    with engine({"CUDA_VISIBLE_DEVICES": "2,3"}, SLEEP, marker):
        env = attach_env(config, {"PATH": "/usr/bin"}, HostFS("/"))
        assert env == {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "2,3"}
        _, placement = prepare(config, env, host)
        assert [r.device.bus_id for r in placement.ranks] == list(GPUS[2:])
        # The supervisor's own variable wins (a difference is warned about when found).
        mine = {"CUDA_VISIBLE_DEVICES": "0"}
        assert attach_env(config, mine, HostFS("/")) == mine
    # No engine running at start: the supervisor's environment as it is.
    assert attach_env(config, {"PATH": "/usr/bin"}, HostFS("/")) == {"PATH": "/usr/bin"}


def test_a_difference_between_the_engine_and_the_plan_is_put_in_words(tmp_path: Path) -> None:
    topology, _ = prepare(attach_config("nothing"), {}, fixture_host(tmp_path))
    devices = topology.devices
    assert visibility_difference(devices, {}, {}) is None
    assert (
        visibility_difference(
            devices, {"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "2,3"}
        )
        is None
    )
    assert visibility_difference(devices, {}, {"CUDA_VISIBLE_DEVICES": "2,3"}) == (
        "it sees nvidia2, nvidia3 (CUDA_VISIBLE_DEVICES='2,3'), "
        "the plan has nvidia0, nvidia1, nvidia2, nvidia3"
    )
    # The order is the ordinal: 3,2 makes GPU 3 the engine's device 0.
    assert (
        visibility_difference(
            devices, {"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "3,2"}
        )
        is not None
    )
    got = visibility_difference(devices, {}, {"CUDA_VISIBLE_DEVICES": "7"})
    assert got is not None and got.startswith("its visibility variables do not fit this host")
