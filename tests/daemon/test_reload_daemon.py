"""Config reload on SIGHUP, on real daemons: real signals (to the daemon and to its
whole process group), a real AF_UNIX socket standing in for systemd's notify
socket, the children's pids and thread affinities read from /proc."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from supervisor.cpulist import format_cpulist
from supervisor.daemon.reload import CONFIG_WATCH_S
from supervisor.hostfs import HostFS
from supervisor.procfs.stat import read_proc_stat
from tests.support.children import report_of, thread_cpus, write_child
from tests.support.daemon_support import (
    REPO,
    DaemonProcess,
    child_config,
    daemon_env,
    entries,
    run_supervisor,
    to_toml,
)
from tests.support.poll import poll

FS = HostFS("/")


def pids_of(doc: dict[str, Any]) -> dict[str, int]:
    return {str(e.get("rank", "engine")): e["pid"] for e in entries(doc)}


def reloads(daemon: DaemonProcess) -> dict[str, int]:
    doc = daemon.placement() or {}
    counted: dict[str, int] = doc.get("supervisor", {}).get("config_reloads", {})
    return counted


def metrics(daemon: DaemonProcess) -> str:
    url = f"http://127.0.0.1:{daemon.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text: str = resp.read().decode()
        return text


def recv_until(sock: socket.socket, wanted: Callable[[bytes], bool]) -> bytes:
    """Datagrams until one is `wanted` (the socket's timeout bounds each wait)."""
    while True:
        message = sock.recv(4096)
        if wanted(message):
            return message


def fields(message: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in message.decode().splitlines())


def alive(pid: int) -> bool:
    stat = read_proc_stat(FS, pid)
    return stat is not None and stat.state not in ("Z", "X")


@contextlib.contextmanager
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(30)
    try:
        yield sock, path
    finally:
        sock.close()


def write(config: Path, doc: dict[str, Any]) -> str:
    text = to_toml(doc)
    config.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def test_invalid_or_unreloadable_config_keeps_the_old_one_and_the_daemon_ready(
    tmp_path: Path,
) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    doc = child_config(script, out)
    digest = write(config, doc)
    log = tmp_path / "stderr.log"
    with (
        notify_socket(tmp_path) as (notify, path),
        DaemonProcess(config, log, env=daemon_env(NOTIFY_SOCKET=path)) as daemon,
    ):
        recv_until(notify, lambda m: m.startswith(b"READY=1"))
        before = pids_of(poll(daemon.running, timeout_s=60))
        assert (daemon.placement() or {})["supervisor"]["config_hash"] == digest
        config.write_text(to_toml(doc).replace("backoff_max_s = 1.0", 'backoff_max_s = "soon"'))
        os.kill(daemon.pid, signal.SIGHUP)
        assert fields(recv_until(notify, lambda m: m.startswith(b"RELOADING=1")))["STATUS"]
        ready = recv_until(notify, lambda m: m.startswith(b"READY=1"))
        assert b"STATUS=2/2 running" in ready
        poll(lambda: reloads(daemon).get("invalid") == 1, what="an invalid reload counted")
        errors = [line for line in daemon.tail(20000).splitlines() if " ERROR " in line]
        assert len(errors) == 1, errors
        assert "reload failed" in errors[0] and str(config) in errors[0]
        assert "restart.backoff_max_s" in errors[0] and "keep old config" in errors[0]
        assert 'placement_config_reloads_total{result="invalid"} 1.0' in metrics(daemon)
        assert daemon.events("reload")
        # A valid file the fleet cannot run live: one rank fewer.
        write(config, {**doc, "cpu_ranks": 1})
        os.kill(daemon.pid, signal.SIGHUP)
        recv_until(notify, lambda m: m.startswith(b"RELOADING=1"))
        recv_until(notify, lambda m: m.startswith(b"READY=1"))
        poll(lambda: reloads(daemon).get("refused") == 1, what="a refused reload counted")
        refused = [line for line in daemon.tail(20000).splitlines() if "reload refused" in line]
        assert len(refused) == 1 and "needs a restart" in refused[0], refused
        now = poll(daemon.running)
        assert daemon.proc.poll() is None and pids_of(now) == before
        assert now["supervisor"]["config_hash"] == digest and now["supervisor"]["ready"]
        assert len(now["ranks"]) == 2


def test_an_env_change_restarts_only_that_process_and_publishes_the_new_hash(
    tmp_path: Path,
) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    doc = child_config(script, out, engine=True)
    write(config, doc)
    with DaemonProcess(config, tmp_path / "stderr.log", env=daemon_env()) as daemon:
        before = pids_of(poll(daemon.running, timeout_s=60))
        doc["engine"]["env"] = {"DEMO_DEFAULT": "2"}
        digest = write(config, doc)
        os.kill(daemon.pid, signal.SIGHUP)
        poll(lambda: reloads(daemon).get("ok") == 1, what="a reload counted")

        def engine_restarted() -> dict[str, int] | None:
            running = daemon.running()
            if running is None or pids_of(running)["engine"] == before["engine"]:
                return None
            return pids_of(running)

        after = poll(engine_restarted, timeout_s=30, what="the engine restarted")
        assert after["0"] == before["0"] and after["1"] == before["1"]
        assert alive(before["0"]) and alive(before["1"])
        report = poll(lambda: report_of(out, "engine", after["engine"]))
        assert report["env"]["DEMO_DEFAULT"] == "2"
        assert (daemon.placement() or {})["supervisor"]["config_hash"] == digest
        assert f'sha256="{digest}"' in metrics(daemon)
        assert 'placement_config_reloads_total{result="ok"} 1.0' in metrics(daemon)


def test_a_role_change_rebinds_the_process_in_place(tmp_path: Path) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    doc = child_config(script, out, cpu_ranks=1)
    doc["drift"] = {"check_interval_s": 0.2}
    write(config, doc)
    with DaemonProcess(config, tmp_path / "stderr.log", env=daemon_env()) as daemon:
        first = poll(daemon.running, timeout_s=60)
        pid = first["ranks"][0]["pid"]
        whole = format_cpulist(first["ranks"][0]["cpus"])
        assert set(thread_cpus(pid).values()) == {whole}
        doc["placement"]["rank_roles"] = {"comm": 1}
        write(config, doc)
        os.kill(daemon.pid, signal.SIGHUP)
        poll(lambda: reloads(daemon).get("ok") == 1, what="a reload counted")
        now = poll(daemon.running)
        roles = now["ranks"][0]["roles"]
        assert "comm" in roles
        main = format_cpulist(roles["main"])
        assert main != whole
        poll(lambda: thread_cpus(pid).get(pid) == main, what="the main thread on its new role")
        assert now["ranks"][0]["pid"] == pid and alive(pid)


def test_hups_in_a_row_coalesce_with_reloading_then_ready_and_monotonic_usec(
    tmp_path: Path,
) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    write(config, child_config(script, out))
    with (
        notify_socket(tmp_path) as (notify, path),
        DaemonProcess(config, tmp_path / "stderr.log", env=daemon_env(NOTIFY_SOCKET=path)) as d,
    ):
        recv_until(notify, lambda m: m.startswith(b"READY=1"))
        poll(d.running, timeout_s=60)
        sent_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        for _ in range(5):
            os.kill(d.pid, signal.SIGHUP)
        reloading = fields(recv_until(notify, lambda m: m.startswith(b"RELOADING=1")))
        now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        # CLOCK_MONOTONIC is one clock for every process of the host.
        assert sent_us <= int(reloading["MONOTONIC_USEC"]) <= now_us
        recv_until(notify, lambda m: m.startswith(b"READY=1"))
        poll(lambda: reloads(d).get("ok", 0) >= 1)
        # Then a quiet moment: every reload that will come has come (bounded by READYs).
        notify.settimeout(2)
        extra = 0
        with contextlib.suppress(TimeoutError):
            while True:
                if notify.recv(4096).startswith(b"RELOADING=1"):
                    extra += 1
        assert extra <= 1  # five HUPs: one reload, at most one more
        assert reloads(d).get("ok") == 1 + extra
        assert d.proc.poll() is None


def test_a_hup_to_the_whole_process_group_is_a_reload_and_no_child_dies(
    tmp_path: Path,
) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    write(config, child_config(script, out, engine=True))
    with DaemonProcess(
        config, tmp_path / "stderr.log", env=daemon_env(), new_session=True
    ) as daemon:
        before = pids_of(poll(daemon.running, timeout_s=60))
        assert os.getpgid(daemon.pid) == daemon.pid
        children = [
            int(n)
            for n in os.listdir("/proc")
            if n.isdigit() and (st := read_proc_stat(FS, int(n))) and st.ppid == daemon.pid
        ]
        assert set(before.values()) < set(children)  # and the guardian
        os.killpg(daemon.pid, signal.SIGHUP)  # what a closed terminal sends
        poll(lambda: reloads(daemon).get("ok") == 1, what="the group's HUP was a reload")
        assert daemon.proc.poll() is None
        assert all(alive(pid) for pid in children)
        assert pids_of(poll(daemon.running)) == before
        assert daemon.stop() == 0


def test_a_reload_during_a_readiness_wait_leaves_the_wait_and_the_next_spawn_has_the_new_spec(
    tmp_path: Path,
) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    doc = child_config(script, out, engine=True)
    doc["engine"]["command"][-1] = "sleep"  # never writes its ready file: we do
    doc["ready"]["timeout_s"] = 120
    write(config, doc)
    with DaemonProcess(config, tmp_path / "stderr.log", env=daemon_env()) as daemon:

        def engine_waiting() -> int | None:
            doc = daemon.placement()
            engine = (doc or {}).get("engine") or {}
            return engine.get("pid") if engine.get("state") == "starting" else None

        engine_pid = poll(engine_waiting, timeout_s=60, what="the engine waiting for readiness")
        doc["workers"]["env"] = {"DEMO_DEFAULT": "reloaded"}
        write(config, doc)
        os.kill(daemon.pid, signal.SIGHUP)
        poll(lambda: reloads(daemon).get("ok") == 1, what="a reload counted")
        assert engine_waiting() == engine_pid  # the same wait, not a restart
        (out / "engine.ready").touch()
        running = poll(daemon.running, timeout_s=30)
        assert pids_of(running)["engine"] == engine_pid
        for rank in ("0", "1"):
            report = poll(lambda r=rank: report_of(out, r, pids_of(running)[r]))
            assert report["env"]["DEMO_DEFAULT"] == "reloaded"


def test_a_reload_that_fixes_a_crash_looping_command_restarts_it_from_its_backoff(
    tmp_path: Path,
) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    doc = child_config(script, out, mode="crash-rank-1")
    # One crash, then a 60 s backoff: the new command runs long before it ends.
    doc["restart"].update(backoff_initial_s=60.0, backoff_max_s=60.0, crash_loop_limit=1000)
    write(config, doc)
    with DaemonProcess(config, tmp_path / "stderr.log", env=daemon_env()) as daemon:
        poll(
            lambda: any(
                r["state"] == "backoff" for r in (daemon.placement() or {"ranks": []})["ranks"]
            ),
            timeout_s=60,
            what="rank 1 in its backoff",
        )
        doc["workers"]["command"][-1] = "sleep"
        write(config, doc)
        os.kill(daemon.pid, signal.SIGHUP)
        running = poll(daemon.running, timeout_s=20, what="both ranks up on the new command")
        assert reloads(daemon).get("ok") == 1
        pid = running["ranks"][1]["pid"]
        poll(lambda: report_of(out, "1", pid), what="rank 1's report")
        assert alive(pid)


def _config_doc(daemon: DaemonProcess) -> dict[str, Any]:
    doc = daemon.placement() or {}
    config: dict[str, Any] = doc["config"]
    return config


def _metric_line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(name))


def test_a_reload_verdict_stays_until_the_next_and_the_file_on_disk_shows_beside_the_one_in_force(
    tmp_path: Path,
) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    doc = child_config(script, out)
    digest = write(config, doc)
    with (
        notify_socket(tmp_path) as (notify, path),
        DaemonProcess(config, tmp_path / "d.log", env=daemon_env(NOTIFY_SOCKET=path)) as daemon,
    ):
        recv_until(notify, lambda m: m.startswith(b"READY=1"))
        before = pids_of(poll(daemon.running, timeout_s=60))
        assert _config_doc(daemon) == {
            "path": str(config),
            "in_force": digest,
            "on_disk": digest,
            "last_reload": None,
        }
        text = metrics(daemon)
        assert _metric_line(text, "placement_config_last_reload_successful").endswith(" 1.0")
        assert f'placement_config_on_disk_info{{sha256="{digest}"}} 1.0' in text

        # An invalid file: refused, and said so until the next reload.
        bad = to_toml(doc).replace("backoff_max_s = 1.0", 'backoff_max_s = "soon"')
        config.write_text(bad)
        bad_digest = hashlib.sha256(bad.encode()).hexdigest()
        os.kill(daemon.pid, signal.SIGHUP)
        ready = fields(recv_until(notify, lambda m: m.startswith(b"READY=1")))["STATUS"]
        assert ready.startswith("2/2 running; ready; reload invalid: ")
        assert f"{config}: restart.backoff_max_s: " in ready, ready
        shown = _config_doc(daemon)
        assert shown["in_force"] == digest and shown["on_disk"] == bad_digest
        last = shown["last_reload"]
        assert last["result"] == "invalid" and "restart.backoff_max_s" in last["error"]
        assert last["at"] <= time.time()
        text = metrics(daemon)
        assert _metric_line(text, "placement_config_last_reload_successful").endswith(" 0.0")
        assert f'placement_config_on_disk_info{{sha256="{bad_digest}"}} 1.0' in text
        assert f'sha256="{digest}"' in _metric_line(text, "placement_config_info")
        # A later STATUS= (rank 1 killed and restarted) still carries the verdict.
        os.kill(before["1"], signal.SIGKILL)
        later = recv_until(notify, lambda m: m.startswith(b"STATUS=1/2 running"))
        assert b"; reload invalid: " in later, later

        # A valid edit nobody reloaded yet: on disk, not in force.
        doc["workers"]["env"] = {"DEMO_DEFAULT": "3"}
        good = write(config, doc)
        poll(
            lambda: _config_doc(daemon)["on_disk"] == good,
            timeout_s=2 * CONFIG_WATCH_S + 5,  # one read of the file every CONFIG_WATCH_S
            what="the edit on disk",
        )
        assert _config_doc(daemon)["in_force"] == digest
        # Reloaded: applied, and in force.
        os.kill(daemon.pid, signal.SIGHUP)
        ready = fields(recv_until(notify, lambda m: m.startswith(b"READY=1")))["STATUS"]
        assert ready.endswith("; reload applied"), ready
        shown = _config_doc(daemon)
        assert shown["in_force"] == shown["on_disk"] == good
        assert shown["last_reload"]["result"] == "ok" and shown["last_reload"]["error"] is None
        assert _metric_line(metrics(daemon), "placement_config_last_reload_successful").endswith(
            " 1.0"
        )


def _reload_cli(daemon: DaemonProcess, *extra: str) -> subprocess.CompletedProcess[str]:
    listen = f"127.0.0.1:{daemon.port}"
    return run_supervisor("reload", "--listen", listen, "--timeout", "30", *extra)


def test_the_reload_command_waits_for_the_verdict_and_says_it(tmp_path: Path) -> None:
    script, out = write_child(tmp_path)
    config = tmp_path / "c.toml"
    doc = child_config(script, out)
    write(config, doc)
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as daemon:
        poll(daemon.running, timeout_s=60)
        config.write_text(to_toml(doc).replace("backoff_max_s = 1.0", 'backoff_max_s = "soon"'))
        done = _reload_cli(daemon)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stdout.startswith(f"invalid: {config}: restart.backoff_max_s: "), done.stdout

        write(config, {**doc, "cpu_ranks": 1})  # valid, but one process fewer
        done = _reload_cli(daemon, "--pid", str(daemon.pid))
        assert done.returncode == 5, done.stdout + done.stderr
        assert done.stdout == "refused: needs a restart: the new plan has 1 processes, 2 run now\n"

        doc["workers"]["env"] = {"DEMO_DEFAULT": "4"}
        digest = write(config, doc)
        done = _reload_cli(daemon)
        assert (done.returncode, done.stdout) == (0, "applied\n"), done.stderr
        assert (daemon.placement() or {})["config"]["in_force"] == digest

        # The pid systemd gives ($MAINPID) must be the daemon the API speaks for.
        done = _reload_cli(daemon, "--pid", str(os.getpid()))
        assert done.returncode == 1 and f"not {os.getpid()}" in done.stderr, done.stderr
        assert reloads(daemon) == {"invalid": 1, "refused": 1, "ok": 1}


def test_the_unit_reloads_through_the_reload_command() -> None:
    """ExecReload runs `reload` with ExecStart's binary and config, and systemd's
    $MAINPID: `systemctl reload` then fails when the config was not applied."""
    unit = (REPO / "systemd/placement-supervisor.service").read_text()
    lines = unit.splitlines()
    start = next(line for line in lines if line.startswith("ExecStart=")).split("=", 1)[1]
    reload = next(line for line in lines if line.startswith("ExecReload=")).split("=", 1)[1]
    binary, config = start.split()[0], start.split()[-1]
    assert reload == f"{binary} reload --config {config} --pid $MAINPID"
