"""`engine.attach.devices` (docs/attach.md): an attached engine's plan has the
accelerators it reaches and no others, and the node agent reads them from a
container's device nodes (supervisor.agent.reach).

The host is a fixture tree of two nodes of four CPUs with two GPUs on each
(nvidia0/1 on node 0, nvidia2/3 on node 1) and the engine's cgroup /eng holding
all eight CPUs, the world of a container given GPUs 2 and 3 by its runtime. The
reach is read from device nodes made with mknod(2) under the fixture's
proc/<pid>/root/dev and stat(2)ed as the agent does; the agent's own run, a real
runc container with renamed nodes, is tests/agent/test_agent_devices.py.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.agent.node import child_config, child_env
from supervisor.agent.reach import Reach, container_reach
from supervisor.config import Config, parse_config
from supervisor.daemon.root import prepare
from supervisor.errors import ConfigError
from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from supervisor.plan.placement import Placement
from supervisor.topology.device_minors import read_char_devices
from supervisor.topology.model import Topology
from tests.support.daemon_support import REPO

GPUS = ("0000:1a:00.0", "0000:1b:00.0", "0000:9a:00.0", "0000:9b:00.0")  # minors 0-3
THEIRS = [GPUS[2], GPUS[3]]  # the container's: node 1's two


def host(tmp_path: Path, *, proc_entry: bool = True) -> HostFS:
    builder = (
        FakeHost(tmp_path)
        .cpus(2, 4, 1)
        .cgroup_v1("/", "0-7", "0-1")
        .raw("sys/fs/cgroup/cpuset/eng/cpuset.cpus", "0-7\n")
        .raw("sys/fs/cgroup/cpuset/eng/cpuset.effective_cpus", "0-7\n")
        .raw("sys/fs/cgroup/cpuset/eng/cpuset.effective_mems", "0-1\n")
    )
    for i, bdf in enumerate(GPUS):
        builder = builder.nvidia_gpu(bdf, i // 2, proc_entry=proc_entry)
    return HostFS(str(builder.build()))


def config(attach: dict[str, Any]) -> Config:
    return parse_config(
        {
            "engine": {"attach": {"cgroup": "/eng", **attach}, "kind": "vllm"},
            "placement": {"rank_roles": {}, "on_shortage": "share"},
        },
        "c.toml",
    )


def planned(placement: Placement) -> dict[str, tuple[int, ...]]:
    """PCI address -> the rank's CPUs (the plan has a rank per visible device)."""
    return {str(r.device.bus_id): tuple(sorted(r.slot.cpus)) for r in placement.ranks}


def plan_for(
    fs: HostFS, attach: dict[str, Any], env: dict[str, str] | None = None
) -> tuple[Topology, Placement]:
    return prepare(config(attach), env or {}, fs)


# -- the config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ("0000:9a:00.0", "engine.attach.devices: expected a list of strings"),
        (["0000:9a:00.0", "gpu2"], "engine.attach.devices: item 1: expected a PCI address"),
        (
            ["0000:9A:00.0", "0000:9a:00.0"],
            "engine.attach.devices: item 1: '0000:9a:00.0' is listed twice",
        ),
    ],
)
def test_attach_devices_errors_name_the_item(devices: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config({"devices": devices})
    assert message in str(info.value), str(info.value)


def test_attach_devices_are_normalized_and_kept_in_the_target() -> None:
    target = config({"devices": ["0000:9A:00.0", "0000:9b:00.0"]}).engine
    assert target is not None and target.attach is not None
    assert target.attach.devices == ("0000:9a:00.0", "0000:9b:00.0")
    assert config({}).engine.attach.devices is None  # type: ignore[union-attr]


# -- the plan -----------------------------------------------------------------------------


def test_the_plan_has_the_reached_devices_only(tmp_path: Path) -> None:
    """Two ranks, not four with two waiting: node 1's four CPUs go to them and the
    engine (rank 0's node, node 0 being too small for the engine's slot)."""
    fs = host(tmp_path)
    topology, placement = plan_for(fs, {"devices": THEIRS})
    assert [d.bdf for d in topology.devices] == THEIRS
    got = planned(placement)
    assert list(got) == THEIRS
    assert placement.engine is not None
    ranks = {c for v in got.values() for c in v}
    assert ranks | set(placement.engine.cpus) == {4, 5, 6, 7}, (got, placement.engine)
    # Without the reach: the host's four, each a rank (two of them not this engine's).
    _, everything = plan_for(fs, {})
    assert list(planned(everything)) == list(GPUS)


def test_visibility_variables_count_the_reached_devices(tmp_path: Path) -> None:
    """CUDA_VISIBLE_DEVICES=1 in a container given GPUs 2 and 3 is the host's GPU 3."""
    fs = host(tmp_path)
    topology, placement = plan_for(fs, {"devices": THEIRS}, {"CUDA_VISIBLE_DEVICES": "1"})
    visible = [d.bdf for d in topology.devices if d.visible]
    assert visible == [GPUS[3]], topology.devices
    assert planned(placement).keys() == {GPUS[3]}
    # The same value on the whole host means its GPU 1.
    topology, _ = plan_for(fs, {}, {"CUDA_VISIBLE_DEVICES": "1"})
    assert [d.bdf for d in topology.devices if d.visible] == [GPUS[1]]


def test_an_address_the_host_lacks_is_warned_about_and_none_reached_plans_cpu_ranks(
    tmp_path: Path,
) -> None:
    fs = host(tmp_path)
    topology, placement = plan_for(fs, {"devices": [GPUS[2], "0000:77:00.0"]})
    assert [d.bdf for d in topology.devices] == [GPUS[2]]
    assert any("0000:77:00.0 is none of this host's accelerators" in w for w in topology.warnings)
    topology, placement = plan_for(fs, {"devices": []})
    assert {d.kind for d in topology.devices} == {"cpu"}, topology.devices
    assert any("reaches none of this host's 4 accelerators" in w for w in topology.warnings)
    assert placement.ranks


def test_devices_known_by_their_nodes_only_are_all_kept_with_a_warning(tmp_path: Path) -> None:
    """No driver procfs: four GPUs by /dev/nvidiaN, no PCI address to match."""
    fs = host(tmp_path, proc_entry=False)
    topology, _ = plan_for(fs, {"devices": THEIRS})
    assert len(topology.devices) == 4 and all(d.bdf is None for d in topology.devices)
    assert any("cannot be told apart: planning all" in w for w in topology.warnings)


# -- the reach: device nodes in a container's /dev -------------------------------------------


def mknod(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(major, minor))


needs_mknod = pytest.mark.skipif(os.geteuid() != 0, reason="mknod(2) of a device needs root")


@needs_mknod
def test_the_reach_is_the_gpus_whose_numbers_the_containers_nodes_have(tmp_path: Path) -> None:
    """Renamed as a runtime may: the container's nvidia0 is the host's minor 2."""
    fs = host(tmp_path)
    dev = Path(fs.root) / "proc/4242/root/dev"
    mknod(dev / "nvidia0", 195, 2)
    mknod(dev / "nvidia1", 195, 3)
    mknod(dev / "nvidiactl", 195, 255)  # the control node: not a GPU
    mknod(dev / "null", 1, 3)
    (dev / "nvidia9").write_text("")  # a placeholder file, not a device
    numbers = read_char_devices(fs)
    assert container_reach(fs, 4242, numbers) == Reach(tuple(THEIRS))


@needs_mknod
def test_a_node_no_driver_names_makes_the_reach_unknown(tmp_path: Path) -> None:
    fs = host(tmp_path)
    dev = Path(fs.root) / "proc/4242/root/dev"
    mknod(dev / "nvidia0", 195, 2)
    mknod(dev / "nvidia1", 1, 3)  # /dev/null's numbers under a GPU's name
    got = container_reach(fs, 4242, read_char_devices(fs))
    assert got.devices is None and got.unknown == "no driver names /dev/nvidia1 (1:3)", got


def test_no_accelerator_node_reaches_none_and_a_gone_process_is_unknown(tmp_path: Path) -> None:
    fs = host(tmp_path)
    (Path(fs.root) / "proc/4242/root/dev").mkdir(parents=True)
    numbers = read_char_devices(fs)
    assert container_reach(fs, 4242, numbers) == Reach(())
    assert container_reach(fs, 4343, numbers) == Reach(None, "/proc/4343/root/dev: gone")


# -- what the node agent hands its child ------------------------------------------------------


def test_the_child_gets_the_reach_in_its_config_and_the_containers_visibility() -> None:
    doc = child_config({}, "/kubepods/pod1/abc", "vllm", frozenset({4, 5}), tuple(THEIRS))
    assert doc["engine"]["attach"] == {
        "cgroup": "/kubepods/pod1/abc",
        "cpus": "4-5",
        "devices": THEIRS,
    }
    assert "devices" not in child_config({}, "/x", "vllm")["engine"]["attach"]
    # Devices the config names by address have no node to be found by: all kept.
    pci = {"accelerator": "pci", "devices": ["0000:41:00.0"]}
    assert "devices" not in child_config(pci, "/x", "vllm", devices=())["engine"]["attach"]
    agent = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0-7", "NOTIFY_SOCKET": "/run/n"}
    visible = {"CUDA_VISIBLE_DEVICES": "1"}
    env = child_env(agent, "abc", Reach(tuple(THEIRS)), visible)
    assert env == {
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "1",
        "PLACEMENT_SUPERVISOR_INSTANCE": "agent-abc",
    }
    # Its devices unknown: the container's indices would count the host's GPUs.
    env = child_env(agent, "abc", Reach(None, "EACCES"), visible)
    assert "CUDA_VISIBLE_DEVICES" not in env and "NOTIFY_SOCKET" not in env


READ_REACH = """
import json, sys
from supervisor.agent.reach import container_reach
from supervisor.hostfs import HostFS
from supervisor.topology.device_minors import read_char_devices
fs = HostFS("/")
got = container_reach(fs, int(sys.argv[1]), read_char_devices(fs))
print(json.dumps([got.devices, got.unknown]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="reads another user's /proc/<pid>/root as root")
def test_without_ptrace_access_the_reach_is_unknown_and_says_why(tmp_path: Path) -> None:
    """A DaemonSet without SYS_PTRACE (and the DAC capabilities) may not look into
    another user's /proc/<pid>/root: unknown, so the child plans every accelerator,
    never none. With them (plain root here) the same process's /dev is read."""
    if shutil.which("capsh") is None or shutil.which("setpriv") is None:
        pytest.skip("needs capsh (libcap) and setpriv (util-linux)")
    script = tmp_path / "reach.py"
    script.write_text(READ_REACH)
    nobody = ("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups")
    engine = subprocess.Popen([*nobody, sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        command = f"exec {sys.executable} {script} {engine.pid}"

        def reach(*capsh: str) -> list[Any]:
            done = subprocess.run(
                ["capsh", *capsh, "--", "-c", command],
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, done.stderr
            got: list[Any] = json.loads(done.stdout)
            return got

        drop = "--drop=cap_sys_ptrace,cap_dac_override,cap_dac_read_search"
        devices, unknown = reach(drop)
        assert devices is None and unknown == f"/proc/{engine.pid}/root/dev: Permission denied"
        devices, unknown = reach()
        assert unknown is None and isinstance(devices, list), (devices, unknown)
    finally:
        engine.kill()
        engine.wait()
