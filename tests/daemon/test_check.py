"""`placement-supervisor check`: run's start-up probes asked beforehand, on this host and
under the filters a container's runtime sets (real seccomp filters, real capability sets)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.daemon_support import (
    REPO,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

PROBES = (
    "mempolicy",
    "migrate",
    "cgroup",
    "irq",
    "proc_connector",
    "sock_diag",
    "cap_sys_nice",
    "numa_balancing",
)


WORKERS = '[workers]\ncommand = ["python", "-c", "pass", "{rank}"]\n'


def check(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "supervisor", "check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def findings(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """{probe: its line}; every line but the summary is one probe, ok or missing."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stdout.strip().splitlines()
    out = {}
    for line in lines[:-1]:
        state, rest = line.split(None, 1)
        assert state in ("ok", "missing"), line
        name = rest.split(":", 1)[0]
        out[name] = line
        if state == "missing":  # what it costs and how to get it, on the same line
            assert "; costs: " in line and "; to get it: " in line, line
    assert tuple(out) == PROBES, proc.stdout
    return out


def seccomp(mode: str) -> tuple[str, ...]:
    return (sys.executable, str(REPO / "tests/support/seccomp_exec.py"), mode, "--")


def test_check_probes_each_thing_and_exits_by_what_is_missing() -> None:
    proc = check()
    lines = findings(proc)
    missing = [name for name, line in lines.items() if line.startswith("missing")]
    assert proc.returncode == (4 if missing else 0), proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("all present" if not missing else "1 ")


def test_check_under_moby_s_profile_with_sys_nice_names_migrate_only() -> None:
    """migrate_pages and move_pages refused, the policy calls allowed: what moby's
    default seccomp profile gives a container holding CAP_SYS_NICE (it lists
    get_mempolicy, mbind, set_mempolicy with that capability, the movers not at all)."""
    proc = check(prefix=seccomp("migrate"))
    lines = findings(proc)
    assert lines["mempolicy"].startswith("ok       mempolicy: "), lines["mempolicy"]
    assert lines["migrate"].startswith(
        "missing  migrate: pages cannot be moved: migrate_pages refused (EPERM, seccomp?); "
    ), lines["migrate"]
    assert proc.returncode == 4, proc.stdout


def test_the_capability_report_under_that_profile_keeps_mempolicy_and_says_why() -> None:
    code = (
        "from supervisor.bind.capability import probe_mempolicy_and_migrate as p; "
        "c = p([0]); print(c.available, c.reason)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [*seccomp("migrate"), sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    expected = "True pages cannot be moved: migrate_pages refused (EPERM, seccomp?)"
    assert proc.stdout.strip() == expected


def test_check_under_the_runtimes_seccomp_profile_names_mempolicy() -> None:
    proc = check(prefix=seccomp("memory"))
    lines = findings(proc)
    assert lines["mempolicy"].startswith("missing  mempolicy: ") and "EPERM" in lines["mempolicy"]
    assert "SYS_NICE" in lines["mempolicy"]
    assert proc.returncode == 4, proc.stdout


def test_check_with_sock_diag_refused_names_sock_diag() -> None:
    proc = check(prefix=seccomp("1"))
    lines = findings(proc)
    assert lines["sock_diag"].startswith("missing  sock_diag: ") and "EPERM" in lines["sock_diag"]
    assert lines["mempolicy"].startswith("ok"), lines["mempolicy"]
    assert proc.returncode == 4, proc.stdout


@pytest.mark.skipif(
    shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs setpriv, as root"
)
def test_check_without_cap_sys_nice_names_it() -> None:
    proc = check(prefix=("setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", "--"))
    lines = findings(proc)
    assert lines["cap_sys_nice"].startswith("missing  cap_sys_nice: "), lines["cap_sys_nice"]
    assert proc.returncode == 4, proc.stdout


def test_check_config_says_what_is_not_wanted(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'cgroup = "off"\n{WORKERS}[irq]\nenabled = false\n')
    lines = findings(check("--config", str(config)))
    assert lines["cgroup"] == 'ok       cgroup: not wanted (cgroup = "off" in the config)'
    assert lines["irq"] == "ok       irq: not wanted ([irq] enabled = false in the config)"


def test_check_bad_config_is_one_line_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'cgroup = "sometimes"\n{WORKERS}')
    proc = check("--config", str(config))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(config) in lines[0] and "cgroup" in lines[0], proc.stderr


def test_check_says_what_a_daemon_under_the_same_filter_finds(tmp_path: Path) -> None:
    """`check` and `run` under the runtime's seccomp profile agree on mempolicy (a real
    daemon's /placement capabilities beside check's line)."""
    config = tmp_path / "c.toml"
    doc = {
        "cpu_ranks": 1,
        "cgroup": "off",
        "stop_timeout_s": 2,
        "workers": {"command": ["python", "-c", "import time; time.sleep(3600)", "{rank}"]},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
        "irq": {"enabled": False},
    }
    config.write_text(to_toml(doc))
    lines = findings(check("--config", str(config), prefix=seccomp("memory")))
    with DaemonProcess(
        config, tmp_path / "d.log", env=daemon_env(), prefix=seccomp("memory")
    ) as daemon:
        placement = poll(daemon.running, timeout_s=60, what="the worker running")
        caps = placement["supervisor"]["capabilities"]
    assert caps["mempolicy"]["available"] is False
    assert lines["mempolicy"].startswith("missing  mempolicy: ")
    assert caps["mempolicy"]["reason"] in lines["mempolicy"], (caps, lines["mempolicy"])
    assert lines["cgroup"].startswith("ok") and caps["cgroup"]["wanted"] is False
