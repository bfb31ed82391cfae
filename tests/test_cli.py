"""The command line as people run it: a real `python -m supervisor` process for
exit codes and messages, `main()` in-process where only the output matters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import __version__, cli
from supervisor.examples.hosts import (
    UUID_CONTAINER_ORDER,
    UUID_CONTAINER_VISIBLE,
    ascend_a3,
    container_uuid,
    dgx_h100,
    no_accel_2node,
    tight_container,
    xeon6_snc3_b200,
)
from supervisor.plan.placement import Placement
from tests.support.daemon_support import run_supervisor
from tests.support.plan_invariants import check_placement

VISIBILITY = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {
        k: v for k, v in os.environ.items() if k not in VISIBILITY and k != "ROCR_VISIBLE_DEVICES"
    }
    return run_supervisor(*args, env={**base, **(env or {})}, timeout_s=120)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("placement-supervisor: error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def dgx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dgx_h100(tmp_path_factory.mktemp("hosts"))


def test_plan_json_through_the_cli_keeps_the_invariants(dgx: Path) -> None:
    proc = run_cli("plan", "--root", str(dgx), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["version"] == 1 and doc["strategy"] == "numa-affine"
    topology, placement = cli.make_plan(str(dgx), None, {})
    assert Placement.from_doc(doc) == placement
    check_placement(topology, Placement.from_doc(doc))


@pytest.mark.parametrize("build", [ascend_a3, no_accel_2node])
def test_plan_json_on_more_hosts(tmp_path: Path, build: object) -> None:
    root = build(tmp_path)  # type: ignore[operator]
    proc = run_cli("plan", "--root", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    topology, _ = cli.make_plan(str(root), None, {})
    check_placement(topology, Placement.from_doc(json.loads(proc.stdout)))


def test_infeasible_plan_exits_3_with_one_line(tmp_path: Path) -> None:
    proc = run_cli("plan", "--root", str(tight_container(tmp_path)))
    assert proc.returncode == 3
    line = one_error_line(proc)
    assert "rank 2 (nvidia2 on node 1) gets 2 CPUs but needs 3 CPUs" in line
    assert proc.stdout == ""


def test_no_visible_accelerator_exits_3(dgx: Path) -> None:
    proc = run_cli("plan", "--root", str(dgx), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 3
    assert "no visible accelerator: found nvidia0" in one_error_line(proc)


def test_visibility_is_read_from_the_environment(dgx: Path) -> None:
    proc = run_cli("plan", "--root", str(dgx), "--json", env={"CUDA_VISIBLE_DEVICES": "6"})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [r["device"]["index"] for r in doc["ranks"]] == [6]


def test_plan_json_numbers_ranks_by_the_uuid_list(tmp_path: Path) -> None:
    root = container_uuid(tmp_path)
    env = {"CUDA_VISIBLE_DEVICES": UUID_CONTAINER_VISIBLE}
    proc = run_cli("plan", "--root", str(root), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    # rank r = local_rank r = the r-th GPU of the list (GPU 6 first, on node 1).
    assert [r["device"]["index"] for r in doc["ranks"]] == list(UUID_CONTAINER_ORDER)
    assert [r["local_rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    assert [r["device"]["uuid"] for r in doc["ranks"]] == UUID_CONTAINER_VISIBLE.split(",")
    topology, placement = cli.make_plan(str(root), None, env)
    assert Placement.from_doc(doc) == placement
    check_placement(topology, placement)
    node_of = {c.id: c.node for c in topology.cpus}
    for r in doc["ranks"]:
        assert {node_of[c] for c in r["cpus"]} == {r["device"]["numa_node"]}
    assert {node_of[c] for c in doc["engine"]["cpus"]} == {1}


def test_plan_says_where_the_engine_went_on_snc3(tmp_path: Path) -> None:
    root = xeon6_snc3_b200(tmp_path)
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # rank 0 = GPU 4 on node 3
    proc = run_cli("plan", "--root", str(root), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["engine_node"] == 4 and doc["engine"]["mems"] == [4]
    topology, placement = cli.make_plan(str(root), None, env)
    assert Placement.from_doc(doc) == placement
    check_placement(topology, placement)
    assert set(doc["engine"]["cpus"]) <= set(topology.node(4).cpus)
    table = run_cli("plan", "--root", str(root), env=env)
    assert table.returncode == 0, table.stderr
    assert "warning: engine: on node 4, which has no device" in table.stdout


def test_bad_visibility_value_is_one_line(dgx: Path) -> None:
    proc = run_cli("plan", "--root", str(dgx), env={"CUDA_VISIBLE_DEVICES": "9"})
    assert proc.returncode == 3
    assert "CUDA_VISIBLE_DEVICES" in one_error_line(proc)


def test_bad_config_exits_2_naming_file_and_key(dgx: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[workers]\ncommand = ["true"]\n[placement]\nstrategy = "spread"\n')
    proc = run_cli("plan", "--config", str(cfg), "--root", str(dgx))
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert str(cfg) in line and "placement.strategy" in line and "spread" in line


def test_missing_root_and_bad_arguments_exit_2(tmp_path: Path) -> None:
    proc = run_cli("plan", "--root", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert "--root" in one_error_line(proc)
    proc = run_cli("plan", "--frobnicate")
    assert proc.returncode == 2
    assert "unrecognized arguments: --frobnicate" in proc.stderr
    assert run_cli().returncode == 2
    assert run_cli("run").returncode == 2  # --config is required


def test_config_maps_to_settings(dgx: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "ok.toml"
    cfg.write_text(
        '[workers]\ncommand = ["w", "{rank}"]\n'
        '[placement]\nstrategy = "global-slice"\ndevices_per_rank = 2\n'
        "[placement.rank_roles]\nirq = 2\n"
    )
    topology, placement = cli.make_plan(str(dgx), str(cfg), {})
    check_placement(topology, placement)
    assert placement.engine is None  # no [engine] table
    assert placement.strategy == "global-slice" and len(placement.ranks) == 4
    assert set(placement.rank(0).slot.roles) == {"irq", "main"}
    assert len(placement.rank(0).slot.roles["irq"]) == 2  # 2 CPUs = one SMT core


def test_table_output_in_process(dgx: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--root", str(dgx)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "strategy: numa-affine"
    assert lines[1].split() == [
        "rank",
        "device",
        "bdf",
        "node",
        "cpu-nodes",
        "cpus",
        "mems",
        "irq",
        "main",
        "comm",
        "so_compiler",
        "strategy",
        "irqs",
    ]
    assert lines[2].split()[:7] == ["0", "nvidia0", "0000:1b:00.0", "0", "0", "0-13,112-125", "0"]
    assert lines[-1].startswith("engine ")


def test_topology_command(dgx: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["topology", "--root", str(dgx), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert isinstance(doc, dict)
    assert cli.main(["topology", "--root", str(dgx)]) == 0
    assert "0000:1b:00.0" in capsys.readouterr().out


def test_snapshot_reproduces_the_live_plan(tmp_path: Path) -> None:
    out = tmp_path / "snap"
    proc = run_cli("snapshot", str(out))
    assert proc.returncode == 0, proc.stderr
    live = run_cli("plan", "--json")
    again = run_cli("plan", "--root", str(out), "--json")
    assert live.returncode == again.returncode
    assert live.stdout == again.stdout
    assert json.loads(again.stdout)["ranks"]


def test_plan_and_topology_do_not_load_the_daemon() -> None:
    # `run` and `status` import the daemon and aiohttp only when they run.
    heavy = ("aiohttp", "supervisor.daemon.root", "supervisor.serve.status")
    code = (
        f"import sys; from supervisor import cli; print(sorted(set(sys.modules) & {set(heavy)!r}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_listen_argument_is_validated() -> None:
    proc = run_cli("status", "--listen", "nonsense")
    assert proc.returncode == 2
    assert "expected HOST:PORT or unix:PATH" in proc.stderr


def test_version() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"placement-supervisor {__version__}"
