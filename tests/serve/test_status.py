"""`status` against a running API server (TCP and unix socket), its table renderer,
and its exit codes against a real daemon that is loading, then ready."""

from __future__ import annotations

import json
import re
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.config import ApiConfig
from supervisor.cpulist import format_cpulist
from supervisor.errors import EXIT_NOT_READY
from supervisor.listen import parse_listen
from supervisor.plan.placement import IrqAssignment
from supervisor.serve.documents import placement_doc
from supervisor.serve.status import render_status, status_command, status_exit_code
from supervisor.state import Finding, IrqObservation, ReloadVerdict
from tests.support.api_fixture import ServerThread, realistic_snapshot
from tests.support.children import write_child
from tests.support.daemon_support import (
    REPO,
    DaemonProcess,
    child_config,
    daemon_env,
    free_port,
    run_supervisor,
    to_toml,
)
from tests.support.poll import poll


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    sock = tmp_path_factory.mktemp("status") / "api.sock"
    config = ApiConfig(listen=parse_listen("127.0.0.1:0"), unix_socket=str(sock))
    with ServerThread(realistic_snapshot(), config) as srv:
        yield srv


def rows(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    header = lines[1].split()
    assert header[:3] == ["RANK", "PID", "STATE"]
    return {line.split()[0]: line.split() for line in lines[2:] if line and line[0] != " "}


def test_table_shows_every_process(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    listen = str(server.tcp)
    assert status_command(Namespace(listen=listen, json=False)) == 0
    out = capsys.readouterr().out
    table = rows(out)
    snap = server.store.snapshot
    for key in snap.keys():  # noqa: SIM118 (a Snapshot method)
        row = table[str(key)]
        assert row[1] == str(snap.processes[key].pid)
        assert row[2] == snap.processes[key].state
    # CPUs per role in the kernel's list format, main first.
    rank0 = snap.placement.rank(0).slot
    assert f"main={format_cpulist(rank0.roles['main'])}" in table["0"]
    assert out.splitlines()[0].endswith("ready")
    # The drifted thread of rank 1 is counted in the table and spelled out below it.
    assert out.splitlines()[1].split()[-3:] == ["DRIFT", "RESTARTS", "IRQS"]
    assert table["1"][-3] == "1"  # rank 1's IRQS cell is one word ("101")
    assert "drift 1: thread_affinity" in out


def test_json_is_the_raw_document(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    where = next(a for a in server.server.addresses if a.startswith("unix:"))
    assert status_command(Namespace(listen=where, json=True)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(json.dumps(placement_doc(server.store.snapshot)))


def test_unreachable_daemon_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()  # closed again: nobody listens there
    assert status_command(Namespace(listen=f"127.0.0.1:{port}", json=False)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"cannot reach the daemon at 127.0.0.1:{port}" in err
    assert status_command(Namespace(listen=f"unix:{tmp_path / 'none.sock'}", json=True)) == 1
    assert "cannot reach the daemon" in capsys.readouterr().err
    assert status_command(Namespace(listen="nonsense", json=False)) == 2
    assert "--listen" in capsys.readouterr().err


def test_the_config_names_the_address(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        f'[workers]\ncommand = ["true"]\n[api]\nlisten = "{server.tcp}"\n', encoding="utf-8"
    )
    assert status_command(Namespace(listen=None, json=False, config=str(config))) == 0
    assert "RANK" in capsys.readouterr().out


def test_render_shows_backoff_failure_and_not_ready() -> None:
    snap = realistic_snapshot()
    procs = dict(snap.processes)
    procs[1] = replace(procs[1], state="backoff", backoff_s=4.0, pid=None)
    procs[2] = replace(procs[2], state="failed", exit_code=-9, pid=None)
    procs[3] = replace(procs[3], bound=False)
    drift = dict(snap.drift)
    drift[3] = (Finding("memory_locality", "memory", ">= 90% on 1", "71% on 1"),)
    text = render_status(placement_doc(replace(snap, processes=procs, drift=drift)))
    table = rows(text)
    assert table["1"][1:3] == ["-", "backoff(4s)"]
    assert table["2"][1:3] == ["-", "failed(exit"]
    assert table["3"][2] == "running(unbound)"
    assert "NOT READY" in text.splitlines()[0]
    assert "not ready: 1: backoff" in text
    assert "drift 3: memory_locality memory" in text


def test_the_cli_subcommand(server: ServerThread) -> None:
    proc = run_supervisor("status", "--listen", str(server.tcp))
    assert proc.returncode == 0, proc.stderr
    assert str(server.store.snapshot.processes[0].pid) in proc.stdout
    proc = run_supervisor("status", "--listen", str(server.tcp), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ranks"][0]["pid"] == server.store.snapshot.processes[0].pid


# -- exit codes against a real daemon ------------------------------------------------------


def test_exit_code_says_ready_or_not_on_a_real_daemon(tmp_path: Path) -> None:
    """A daemon whose engine's readiness probe has not passed: exit 4 (NOT READY);
    once the probe passes and the workers run bound: exit 0. Same daemon, both states."""
    script, out = write_child(tmp_path)
    gate = tmp_path / "model-loaded"  # the engine's ready.file; the test creates it
    doc = child_config(script, out, engine=True)
    # "sleep": the engine never touches a file itself; the probe waits up to 10 minutes.
    doc["engine"]["command"][-1] = "sleep"
    doc["ready"] = {"file": str(gate), "timeout_s": 600}
    config = tmp_path / "loading.toml"
    config.write_text(to_toml(doc))
    with DaemonProcess(config, tmp_path / "daemon.log", env=daemon_env()) as daemon:
        listen = f"127.0.0.1:{daemon.port}"
        # The engine is spawned and waits for its probe; the workers wait for the engine.
        poll(lambda: (daemon.placement() or {}).get("engine", {}).get("pid"), 30)
        loading = run_supervisor("status", "--listen", listen)
        assert loading.returncode == EXIT_NOT_READY, loading.stdout + loading.stderr
        assert "NOT READY" in loading.stdout.splitlines()[0]
        # spawned, its probe about to start or waiting (with how long, of how long)
        assert re.search(
            r"not ready: engine: (starting|loading \d+s of 600s, file )", loading.stdout
        ), loading.stdout
        as_json = run_supervisor("status", "--listen", listen, "--json")
        assert as_json.returncode == EXIT_NOT_READY, as_json.stderr
        assert json.loads(as_json.stdout)["supervisor"]["ready"] is False

        gate.touch()  # the model "finished loading": the probe passes, workers start
        poll(lambda: daemon.get("/readyz") is not None, 60, what="GET /readyz answers 200")
        ready = run_supervisor("status", "--listen", listen)
        assert ready.returncode == 0, ready.stdout + ready.stderr
        assert ready.stdout.splitlines()[0].endswith(", ready")
        assert "not ready:" not in ready.stdout


def test_exit_code_of_a_document_that_does_not_say() -> None:
    assert status_exit_code({"supervisor": {"ready": True}}) == 0
    assert status_exit_code({"supervisor": {"ready": False}}) == EXIT_NOT_READY
    assert status_exit_code({"ranks": []}) == EXIT_NOT_READY  # readiness unknown is not 0


def test_help_and_readme_list_every_exit_code() -> None:
    proc = run_supervisor("status", "--help")
    assert proc.returncode == 0, proc.stderr
    listed = dict(re.findall(r"^  (\d+)  (.+)$", proc.stdout.split("exit codes:")[1], re.M))
    assert set(listed) == {"0", "1", "2", str(EXIT_NOT_READY)}, proc.stdout
    assert "not ready" in listed[str(EXIT_NOT_READY)]
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Exit codes")[1].split("\n## ")[0]
    status_rows = re.findall(r"^\| `status`[^|]*\| (\d+) \|", section, re.M)
    assert set(status_rows) == {"0", "1", "2", str(EXIT_NOT_READY)}, status_rows


def test_render_says_a_reload_that_did_not_apply_and_an_unreloaded_file() -> None:
    snap = realistic_snapshot()
    assert "config:" not in render_status(placement_doc(snap))
    verdict = ReloadVerdict(
        1.0, "invalid", "/etc/ps.toml: restart.backoff_max_s: expected a number"
    )
    failed = replace(snap, config_hash="aa", config_on_disk_hash="bb", last_reload=verdict)
    lines = [
        line for line in render_status(placement_doc(failed)).splitlines() if "config:" in line
    ]
    assert lines == [
        "config: last reload invalid: /etc/ps.toml: restart.backoff_max_s: expected a number",
        "config: the file on disk is not the one in force (reload it)",
    ]
    applied = replace(failed, config_on_disk_hash="aa", last_reload=ReloadVerdict(2.0, "ok"))
    assert "config:" not in render_status(placement_doc(applied))


def test_reload_help_and_readme_list_every_exit_code() -> None:
    proc = run_supervisor("reload", "--help")
    assert proc.returncode == 0, proc.stderr
    listed = dict(re.findall(r"^  (\d+)  (.+)$", proc.stdout.split("exit codes:")[1], re.M))
    assert set(listed) == {"0", "1", "2", "5"}, proc.stdout
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Exit codes")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `reload`[^|]*\| (\d+) \|", section, re.M)
    assert set(rows) == set(listed), rows


def test_table_has_an_irqs_column_with_what_is_off_plan() -> None:
    """A plan with IRQs: each rank's IRQ numbers, and how many the check found elsewhere."""
    snap = realistic_snapshot()
    rank0, rank1, *rest = snap.placement.ranks
    irq_cpus = rank0.slot.role_cpus("irq") or rank0.slot.cpus[:1]
    a0 = [IrqAssignment(n, tuple(irq_cpus), "device", "nvidia0", None) for n in (120, 121, 122)]
    placement = replace(snap.placement, ranks=(replace(rank0, irqs=tuple(a0)), rank1, *rest))
    seen = (
        IrqObservation(120, tuple(irq_cpus), tuple(irq_cpus)),
        IrqObservation(121, (999,), tuple(irq_cpus)),  # moved by someone else
        IrqObservation(122, tuple(irq_cpus), tuple(irq_cpus)),
    )
    observed = dict(snap.observed)
    observed[rank0.rank] = replace(observed[rank0.rank], irqs=seen)
    snap = replace(snap, placement=placement, observed=observed)
    text = render_status(placement_doc(snap))
    assert text.splitlines()[1].split()[-1] == "IRQS"
    table = rows(text)
    assert " ".join(table[str(rank0.rank)][-4:]) == "120-122 (1 off plan)", text
    want = format_cpulist(a.irq for a in rank1.irqs) or "-"
    assert table[str(rank1.rank)][-1] == want and table["engine"][-1] == "-", text
    # no IRQs planned: no column
    bare = tuple(replace(r, irqs=()) for r in placement.ranks)
    snap = replace(snap, placement=replace(placement, ranks=bare))
    assert "IRQS" not in render_status(placement_doc(snap))
