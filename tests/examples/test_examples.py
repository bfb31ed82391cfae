"""`--example NAME`: the named hosts that ship with the package, through a real
`python -m supervisor` process (exit codes, one-line errors, the plan document).

Every shipped config (configs/**/*.toml) must plan on the example of its
accelerator kind, the one its "no devices were found" error names, and the
plan must keep the docs/contracts.md §3 invariants.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor import cli
from supervisor.config import discovery_options, load_config
from supervisor.errors import ConfigError
from supervisor.examples import EXAMPLE_FOR_KIND
from supervisor.examples.catalogue import EXAMPLES, find_example
from supervisor.examples.hosts import UUID_CONTAINER_ORDER, UUID_CONTAINER_VISIBLE, no_accel_2node
from supervisor.hostfs import HostFS
from supervisor.plan.placement import Placement
from supervisor.topology.discover import NoDevicesError, read_topology
from supervisor.topology.model import DiscoveryOptions
from tests.support.daemon_support import REPO, run_supervisor
from tests.support.plan_invariants import check_placement

CONFIGS = REPO / "configs"
SHIPPED = sorted(CONFIGS.rglob("*.toml"))
VISIBILITY = (
    "CUDA_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
)


def run_cli(
    *args: str, env: dict[str, str] | None = None, tmpdir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in VISIBILITY}
    if tmpdir is not None:
        base["TMPDIR"] = str(tmpdir)
    return run_supervisor(*args, env={**base, **(env or {})}, timeout_s=120)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("placement-supervisor: error: "), lines[0]
    return lines[0]


def kind_of(config: Path) -> str:
    return discovery_options(load_config(str(config)), {}).accelerator


def example_for(config: Path) -> str:
    # "auto" configs (the demo, the thread-roles example) are meant for any
    # host; the one without accelerators shows their CPU stand-ins.
    return EXAMPLE_FOR_KIND.get(kind_of(config), "no-accel")


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_config_plans_on_its_example(
    config: Path, tmp_path: Path, example_root: Callable[[str], Path]
) -> None:
    name = example_for(config)
    rel = str(config.relative_to(REPO))
    proc = run_cli("plan", "--config", rel, "--example", name, "--json", tmpdir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    # The same host built here, discovered and planned in-process: the CLI's
    # document is that plan, and it keeps every invariant.
    topology, placement = cli.make_plan(str(example_root(name)), str(config), {})
    assert Placement.from_doc(doc) == placement
    check_placement(topology, placement)
    if kind_of(config) != "auto":
        assert {r["device"]["kind"] for r in doc["ranks"]} == {kind_of(config)}
    # The temporary tree is gone once the command ends.
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.name)
def test_each_list_line_says_what_discovery_finds(
    example: object, example_root: Callable[[str], Path]
) -> None:
    e = find_example(example.name)  # type: ignore[attr-defined]
    topology = read_topology(HostFS(str(example_root(e.name))), DiscoveryOptions())
    assert len({c.package for c in topology.cpus}) == e.sockets
    assert len(topology.nodes) == e.nodes
    assert len(topology.cpus) == e.cpus
    accelerators = [d for d in topology.devices if d.kind != "cpu"]
    assert len(accelerators) == e.accelerators
    assert {d.kind for d in accelerators} == ({e.kind} if e.accelerators else set())


def test_example_list_prints_every_name_with_its_line() -> None:
    for command in ("topology", "plan"):
        proc = run_cli(command, "--example", "list")
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert [line.split()[0] for line in lines] == [e.name for e in EXAMPLES]
        for line, e in zip(lines, EXAMPLES, strict=True):
            assert line.endswith(e.describe())
    names = {e.name for e in EXAMPLES}
    assert {"dgx-h100", "gb200", "mi300x", "ascend-16npu", "epyc-nps4"} <= names
    assert set(EXAMPLE_FOR_KIND.values()) <= names
    dgx = next(line for line in lines if line.startswith("dgx-h100 "))
    assert "2 sockets, 2 NUMA nodes, 224 CPUs, 8 NVIDIA" in dgx


def test_unknown_example_exits_2_naming_it_and_the_nearest(tmp_path: Path) -> None:
    proc = run_cli("plan", "--example", "dgx-h10", tmpdir=tmp_path)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "--example dgx-h10: unknown example; did you mean `dgx-h100`?" in line
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing was built
    proc = run_cli("topology", "--example", "amd")
    assert proc.returncode == 2
    assert "did you mean `mi300x`?" in one_error_line(proc)


def test_names_match_loosely_and_the_builders_name_is_an_alias() -> None:
    assert find_example("DGX_H100").name == "dgx-h100"
    assert find_example("gb200_tray").name == "gb200"
    assert find_example("dgx_a100_nps4").name == "epyc-nps4"
    with pytest.raises(ConfigError, match="did you mean `ascend-16npu`"):
        find_example("ascend16")


def test_example_and_root_together_exit_2(tmp_path: Path) -> None:
    for command in (["plan"], ["topology"], ["snapshot", str(tmp_path / "out")]):
        proc = run_cli(*command, "--example", "gb200", "--root", "/")
        assert proc.returncode == 2
        line = one_error_line(proc)
        assert "--example gb200 and --root /: give one" in line
    assert not (tmp_path / "out").exists()


def test_the_no_devices_error_names_the_example_that_plans(tmp_path: Path) -> None:
    root = no_accel_2node(tmp_path)
    configs = {
        "nvidia": "configs/engines/vllm.toml",
        "amd": "configs/amd-mi300x.toml",
        "ascend": "configs/ascend-16npu.toml",
    }
    for kind, rel in configs.items():
        proc = run_cli("plan", "--config", rel, "--root", str(root))
        assert proc.returncode == 3
        line = one_error_line(proc)
        assert f"accelerator = '{kind}' but no {kind} devices were found under {root}" in line
        suggested = re.search(r"to see this config's plan on a host without them: (.*?) \(", line)
        assert suggested is not None, line
        command = f"placement-supervisor plan --config {rel} --example {EXAMPLE_FOR_KIND[kind]}"
        assert suggested.group(1) == command
        assert "(all examples: placement-supervisor topology --example list)" in line
    # The suggested command, as typed: it plans.
    proc = run_cli(*shlex.split(command)[1:], "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["ranks"]) == 16


def test_a_config_on_the_wrong_example_names_the_right_one() -> None:
    proc = run_cli("plan", "--config", "configs/engines/vllm.toml", "--example", "mi300x")
    assert proc.returncode == 3
    line = one_error_line(proc)
    assert "no nvidia devices were found in example mi300x; this config plans on: " in line
    assert "plan --config configs/engines/vllm.toml --example dgx-h100" in line


def test_no_devices_error_without_a_config_or_example_kind() -> None:
    # Discovery alone does not know the config's path; `pci` has no example.
    assert "--config FILE --example dgx-h100" in str(NoDevicesError("nvidia", "/"))
    assert str(NoDevicesError("pci", "/h")) == (
        "accelerator = 'pci' but no pci devices were found under /h"
    )
    quoted = NoDevicesError("amd", "/").located("my configs/a.toml", None)
    assert "--config 'my configs/a.toml' --example mi300x" in str(quoted)
    assert quoted.exit_code == 3


def test_visibility_variables_apply_to_examples() -> None:
    proc = run_cli("plan", "--example", "dgx-h100", "--json", env={"CUDA_VISIBLE_DEVICES": "6"})
    assert proc.returncode == 0, proc.stderr
    assert [r["device"]["index"] for r in json.loads(proc.stdout)["ranks"]] == [6]
    env = {"CUDA_VISIBLE_DEVICES": UUID_CONTAINER_VISIBLE}
    proc = run_cli("plan", "--example", "container-uuid", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    ranks = json.loads(proc.stdout)["ranks"]
    assert [r["device"]["index"] for r in ranks] == list(UUID_CONTAINER_ORDER)
    proc = run_cli("plan", "--example", "dgx-h100", env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 3
    assert "no visible accelerator" in one_error_line(proc)


def test_topology_and_snapshot_of_an_example(tmp_path: Path) -> None:
    proc = run_cli("topology", "--example", "gb200", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc["nodes"]) == 18
    out = tmp_path / "snap"
    proc = run_cli("snapshot", str(out), "--example", "epyc-nps4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("snapshot: ") and "from example epyc-nps4" in proc.stdout
    direct = run_cli("plan", "--example", "epyc-nps4", "--json")
    again = run_cli("plan", "--root", str(out), "--json")
    assert direct.returncode == again.returncode == 0
    assert direct.stdout == again.stdout
    # GPU 0 and 1 sit on node 3 (EPYC NPS4: GPU order is not node order).
    ranks = json.loads(direct.stdout)["ranks"]
    assert [r["device"]["numa_node"] for r in ranks[:2]] == [3, 3]
