"""Engines and workers as an unprivileged user: the shim drops root after binding.

Real processes as the real `nobody` account: /proc/<pid>/status shows the
uid, the groups and the CPUs; a failed drop never execs; the parent-death
signal survives the drop; the daemon supervises a `nobody` worker.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.bind.report import parse_shim_report, shim_argv
from supervisor.config import parse_config
from supervisor.cpulist import format_cpulist
from supervisor.errors import ConfigError
from supervisor.run.shim import EXIT_CREDENTIALS
from supervisor.run.users import resolve_account, resolve_accounts
from tests.support.children import read_all, start_shimmed, status_field
from tests.support.daemon_support import (
    DaemonProcess,
    daemon_env,
    free_port,
    run_supervisor,
    to_toml,
)
from tests.support.poll import poll, wait_until

NOBODY = pwd.getpwnam("nobody")
NOBODY_IDS = (NOBODY.pw_uid, NOBODY.pw_gid, (NOBODY.pw_gid,))
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory `nobody` can write (pytest's tmp_path is root's, mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="ps-accounts-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ids_of(pid: int) -> tuple[str, str, str]:
    """(Uid, Gid, Groups) lines of /proc/<pid>/status: real, effective, saved, fs."""
    return (status_field(pid, "Uid"), status_field(pid, "Gid"), status_field(pid, "Groups"))


def test_resolve_account_by_name_and_number() -> None:
    by_name = resolve_account("nobody", None, "c.toml: workers")
    assert (by_name.uid, by_name.gid) == (NOBODY.pw_uid, NOBODY.pw_gid)
    assert NOBODY.pw_gid in by_name.groups
    assert by_name.env() == {"HOME": NOBODY.pw_dir, "USER": "nobody", "LOGNAME": "nobody"}
    assert resolve_account(str(NOBODY.pw_uid), "0", "w").gid == 0


@pytest.mark.parametrize(
    ("user", "group", "message"),
    [
        ("no-such-user-ps", None, "c.toml: engine.user: no such user 'no-such-user-ps'"),
        ("nobody", "no-such-group-ps", "c.toml: engine.group: no such group 'no-such-group-ps'"),
    ],
)
def test_an_unknown_user_or_group_is_a_config_error(
    user: str, group: str | None, message: str
) -> None:
    doc: dict[str, Any] = {
        "engine": {"command": ["e"], "user": user},
        "workers": {"command": ["w"]},
    }
    if group is not None:
        doc["engine"]["group"] = group
    with pytest.raises(ConfigError) as info:
        resolve_accounts(parse_config(doc, "c.toml"))
    assert str(info.value).startswith(message)


def test_a_shimmed_worker_runs_as_nobody_bound_to_its_cpus() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    proc, report = start_shimmed(
        [cpu],
        [],
        ["sleep", "30"],
        shim={"mempolicy": "none", "user": NOBODY_IDS},
    )
    try:
        assert report.user_error is None and not report.exec_failed
        assert (report.uid, report.gid) == (NOBODY.pw_uid, NOBODY.pw_gid)
        uid, gid, groups = ids_of(proc.pid)
        assert uid.split() == [str(NOBODY.pw_uid)] * 4  # real, effective, saved, fs
        assert gid.split() == [str(NOBODY.pw_gid)] * 4
        assert groups.split() == [str(NOBODY.pw_gid)]  # root's groups are gone
        assert status_field(proc.pid, "Cpus_allowed_list") == str(cpu)
        assert status_field(proc.pid, "CapEff") == "0000000000000000"
    finally:
        proc.kill()
        proc.wait()


def test_a_failed_drop_is_reported_and_nothing_runs(shared_dir: Path) -> None:
    # A shim that is not root itself cannot become uid 1: setgroups fails with
    # EPERM, and the command must not run under the identity it has instead.
    marker = shared_dir / "ran"
    r, w = os.pipe()
    argv = shim_argv(sys.executable, [], [], ["touch", str(marker)], report_fd=w, user=(1, 1, (1,)))
    as_nobody = [SETPRIV, f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups"]
    done = subprocess.run(
        as_nobody + argv, pass_fds=[w], capture_output=True, text=True, timeout=60, check=False
    )
    os.close(w)
    report = parse_shim_report(read_all(r))
    assert done.returncode == EXIT_CREDENTIALS
    assert report.exec_failed
    assert report.user_error is not None
    assert report.user_error.startswith("cannot run as uid 1 gid 1: setgroups([1]): EPERM")
    assert report.user_error in done.stderr
    assert not marker.exists()


# The worker: a shell (any account can run /bin/sh; the test's own Python may
# live under root's 0700 home) that writes TERM to its marker on SIGTERM.
PDEATH_CHILD = 'trap "echo TERM > $0; exit 0" TERM; echo ready; while :; do sleep 0.05; done'

# Starts the shim (dropping to nobody), prints the worker's pid, waits to be killed.
MIDDLE = r"""
import os, subprocess, sys
from supervisor.bind.report import shim_argv
uid, gid = int(sys.argv[1]), int(sys.argv[2])
argv = shim_argv(sys.executable, sorted(os.sched_getaffinity(0)), [], sys.argv[3:],
                 parent_pid=os.getpid(), pdeathsig="TERM", mempolicy="none",
                 user=(uid, gid, [gid]))
child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
sys.stdin.read()
"""


def test_the_parent_death_signal_survives_the_drop(shared_dir: Path) -> None:
    # commit_creds() clears PR_SET_PDEATHSIG on a uid change: the shim sets it again.
    marker = shared_dir / "got-term"
    middle = subprocess.Popen(
        [
            *(sys.executable, "-c", MIDDLE, str(NOBODY.pw_uid), str(NOBODY.pw_gid)),
            *("/bin/sh", "-c", PDEATH_CHILD, str(marker)),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert middle.stdout is not None
    worker = int(middle.stdout.readline())
    try:
        assert status_field(worker, "Uid").split()[0] == str(NOBODY.pw_uid)
        middle.kill()
        middle.wait()
        wait_until(lambda: marker.exists() and marker.read_text() == "TERM\n", 20, 0.02)
        assert marker.read_text() == "TERM\n"
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def test_the_daemon_supervises_a_worker_running_as_nobody(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    doc = {
        "stop_timeout_s": 5,
        # sleep(1): any account can run it (the test's Python may sit in /root).
        "workers": {"command": ["sleep", "600"], "user": "nobody"},
        "placement": {"engine": {"enabled": False}},
    }
    config.write_text(to_toml(doc))
    with DaemonProcess(config, tmp_path / "stderr.log", env=daemon_env()) as daemon:
        first = poll(daemon.running, timeout_s=60)["ranks"][0]
        pid = first["pid"]
        assert status_field(pid, "Uid").split() == [str(NOBODY.pw_uid)] * 4
        assert status_field(pid, "Cpus_allowed_list") in {
            format_cpulist(first["cpus"]),
            format_cpulist(first["roles"]["main"]),
        }
        assert first["mempolicy"]["step"] == "bind"  # bound as root, before the drop
        assert first["bound"] is True
        # Supervised: a killed worker comes back, as nobody again.
        os.kill(pid, signal.SIGKILL)

        def replaced() -> dict[str, Any] | None:
            now = daemon.running()
            return now["ranks"][0] if now and now["ranks"][0]["pid"] != pid else None

        again = poll(replaced, timeout_s=30)
        assert status_field(again["pid"], "Uid").split()[0] == str(NOBODY.pw_uid)
        assert daemon.stop(timeout_s=60) == 0, daemon.tail()
    assert wait_until(lambda: not Path(f"/proc/{again['pid']}").exists(), 10)


def test_run_with_an_unknown_user_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(to_toml({"workers": {"command": ["w"], "user": "no-such-user-ps"}}))
    result = run_supervisor("run", "--config", str(config), env=daemon_env())
    assert result.returncode == 2, result.stderr
    assert f"{config}: workers.user: no such user 'no-such-user-ps'" in result.stderr


UNIT = Path(__file__).resolve().parents[2] / "systemd/placement-supervisor.service"

# The engine: listens on its port (the tcp probe's owner check reads its fd
# table: another user's, so CAP_SYS_PTRACE); /usr/bin/python3 because the
# test's own Python may sit under root's 0700 home.
ENGINE = r"""
import socket, sys
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
while True:
    s.accept()[0].close()
"""


def unit_bounding_set() -> list[str]:
    for line in UNIT.read_text().splitlines():
        if line.startswith("CapabilityBoundingSet="):
            return line.partition("=")[2].split()
    raise AssertionError("the unit has no CapabilityBoundingSet")


def test_the_daemon_works_within_the_units_capabilities(shared_dir: Path, tmp_path: Path) -> None:
    # What the unit leaves the daemon (bounding set, no_new_privs) is enough to
    # bind, drop to nobody, probe the engine's own listener, signal and reap.
    caps = ",".join("+" + c.removeprefix("CAP_").lower() for c in unit_bounding_set())
    engine = shared_dir / "engine.py"
    engine.write_text(ENGINE)
    engine.chmod(0o644)
    port = free_port()
    config = tmp_path / "c.toml"
    doc = {
        "cpu_ranks": 1,
        "stop_timeout_s": 5,
        "engine": {"command": ["/usr/bin/python3", str(engine), str(port)], "user": "nobody"},
        "workers": {"command": ["sleep", "600"], "user": "nobody"},
        "ready": {"tcp": f"127.0.0.1:{port}", "timeout_s": 30},
        "placement": {"rank_roles": {}},
    }
    config.write_text(to_toml(doc))
    confine = [SETPRIV, "--no-new-privs", f"--bounding-set=-all,{caps}"]
    with DaemonProcess(config, tmp_path / "stderr.log", env=daemon_env(), prefix=confine) as daemon:
        doc_now = poll(daemon.running, timeout_s=60)
        assert status_field(daemon.pid, "NoNewPrivs") == "1"
        assert int(status_field(daemon.pid, "CapBnd"), 16) == capability_mask(unit_bounding_set())
        for entry in [doc_now["engine"], *doc_now["ranks"]]:
            assert status_field(entry["pid"], "Uid").split()[0] == str(NOBODY.pw_uid)
            assert entry["bound"] is True
        assert daemon.events("ready")
        assert daemon.stop(timeout_s=60) == 0, daemon.tail()
    pids = [doc_now["engine"]["pid"], doc_now["ranks"][0]["pid"]]
    assert wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 10)


def capability_mask(names: list[str]) -> int:
    """The CapBnd bits of capability names (capability.h numbers)."""
    numbers = {
        "CAP_DAC_OVERRIDE": 1,
        "CAP_DAC_READ_SEARCH": 2,
        "CAP_KILL": 5,
        "CAP_SETGID": 6,
        "CAP_SETUID": 7,
        "CAP_NET_ADMIN": 12,
        "CAP_SYS_PTRACE": 19,
        "CAP_SYS_NICE": 23,
    }
    return sum(1 << numbers[name] for name in names)


def test_a_shim_that_already_is_the_user_needs_no_privilege(shared_dir: Path) -> None:
    # A supervisor run as `nobody` with `user = "nobody"`: nothing to drop, and
    # setgroups (which needs CAP_SETGID even to a no-op) is not called.
    r, w = os.pipe()
    argv = shim_argv(sys.executable, [], [], ["true"], report_fd=w, user=NOBODY_IDS)
    as_nobody = [SETPRIV, f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups"]
    done = subprocess.run(
        as_nobody + argv, pass_fds=[w], capture_output=True, text=True, timeout=60, check=False
    )
    os.close(w)
    report = parse_shim_report(read_all(r))
    assert (done.returncode, report.user_error) == (0, None), done.stderr
    assert (report.uid, report.gid) == (NOBODY.pw_uid, NOBODY.pw_gid)
