"""The systemd unit: `systemd-analyze verify` accepts it, `systemd-analyze security` rates
it <= 5.0, and it says what the daemon needs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from supervisor.config import load_config, parse_config
from supervisor.daemon.state_dir import DEFAULT_STATE_DIR

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd/placement-supervisor.service"
CONFIGS = REPO / "configs"
ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
VENV_COMMAND = REPO / ".venv/bin/placement-supervisor"


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Verify a copy whose ExecStart and ExecReload run this checkout's console script
    (which exists)."""
    if not Path(ANALYZE).exists():
        pytest.skip("systemd-analyze is not installed (run .ci/setup)")
    if not VENV_COMMAND.exists():
        pytest.skip(f"{VENV_COMMAND} is missing (pip install -e .)")
    copy = tmp_path / "placement-supervisor.service"
    copy.write_text(unit_text.replace("=/usr/local/bin/placement-supervisor ", f"={VENV_COMMAND} "))
    return subprocess.run(
        [ANALYZE, "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    result = verify(UNIT.read_text(), tmp_path)
    assert result.returncode == 0, result.stderr
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "placement" in line]
    assert ours == []


def test_verify_would_catch_a_broken_unit(tmp_path: Path) -> None:
    # The control: the same check does flag a mistake, so the test above can fail.
    broken = UNIT.read_text().replace("WatchdogSec=30", "WatchdogSecs=30")
    result = verify(broken, tmp_path)
    assert "WatchdogSecs" in result.stdout + result.stderr


def test_the_unit_says_what_the_daemon_needs() -> None:
    d = directives(UNIT.read_text())
    assert d["Type"] == ["notify"]
    assert d["NotifyAccess"] == ["main"]
    assert d["WatchdogSec"] == ["30"]
    assert d["KillMode"] == ["mixed"]
    assert d["Delegate"] == ["yes"]
    assert d["Restart"] == ["on-failure"]
    # The IRQ checkpoint's home is the one the daemon falls back to without systemd.
    assert [f"/var/lib/{v}" for v in d["StateDirectory"]] == [DEFAULT_STATE_DIR]
    assert set(d["RestartPreventExitStatus"][0].split()) == {"2", "3"}
    exec_start = d["ExecStart"][0].split()
    assert exec_start[0].endswith("/placement-supervisor")
    assert exec_start[1:] == ["run", "--config", "/etc/placement-supervisor/config.toml"]
    # Workers, then the engine, each may take stop_timeout_s before KILL: the
    # default and every shipped config must fit before systemd's own SIGKILL.
    timeouts = [parse_config({"workers": {"command": ["w"]}}).stop_timeout_s]
    timeouts += [load_config(str(p)).stop_timeout_s for p in sorted(CONFIGS.glob("*.toml"))]
    assert len(timeouts) >= 5
    assert float(d["TimeoutStopSec"][0]) > 2 * max(timeouts)


MAX_EXPOSURE = 5.0


def security_score(unit: Path) -> float:
    """The overall exposure `systemd-analyze security --offline=true` gives the unit file."""
    if not Path(ANALYZE).exists():
        pytest.skip("systemd-analyze is not installed (run .ci/setup)")
    result = subprocess.run(
        [ANALYZE, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match is not None, result.stdout + result.stderr
    return float(match.group(1))


def test_systemd_analyze_security_rates_the_unit_at_most_5(tmp_path: Path) -> None:
    score = security_score(UNIT)
    assert score <= MAX_EXPOSURE, f"exposure {score} > {MAX_EXPOSURE}"
    # The control: the same unit without its hardening block is rated unsafe,
    # so the parse above reads a number that moves.
    head = UNIT.read_text().split("# -- Hardening")[0]
    bare = tmp_path / "placement-supervisor.service"
    bare.write_text(head + "\n[Install]\nWantedBy=multi-user.target\n")
    assert security_score(bare) > 9.0


def test_hardening_leaves_open_what_the_daemon_needs() -> None:
    d = directives(UNIT.read_text())
    caps = set(d["CapabilityBoundingSet"][0].split())
    # affinity/migration of others, reading their /proc, signalling them, the shim's setuid
    assert {"CAP_SYS_NICE", "CAP_SYS_PTRACE", "CAP_KILL", "CAP_SETUID", "CAP_SETGID"} <= caps
    assert "CAP_SYS_ADMIN" not in caps
    assert "ProtectKernelTunables" not in d  # /proc/irq must stay writable
    assert "ProtectControlGroups" not in d  # the delegated cgroup subtree too
    assert "PrivateDevices" not in d and "DeviceAllow" not in d  # GPUs
    assert "ProtectClock" not in d  # implies a closed device list
    assert "MemoryDenyWriteExecute" not in d  # JIT in CUDA/Triton/PyTorch
    assert "User" not in d and "DynamicUser" not in d
    # each one left off is explained in the unit itself
    text = UNIT.read_text()
    for name in ("ProtectKernelTunables", "ProtectControlGroups", "PrivateDevices"):
        assert f"#   {name}" in text
    # @resources (sched_setaffinity, set_mempolicy) and @privileged (setuid) stay allowed
    denied = d["SystemCallFilter"][0].removeprefix("~").split()
    assert "@resources" not in denied and "@privileged" not in denied


def test_start_timeout_covers_start_up_not_model_loading() -> None:
    # READY=1 is sent once every process is spawned and bound, not when the
    # engine's probe passes: TimeoutStartSec is shorter than the shipped
    # configs' ready.timeout_s (600, 900 s), and that is the point.
    d = directives(UNIT.read_text())
    start = float(d["TimeoutStartSec"][0])
    assert 60 <= start <= 300
    timeouts = [
        c.ready.timeout_s
        for c in (load_config(str(p)) for p in sorted(CONFIGS.glob("*.toml")))
        if c.ready is not None
    ]
    assert timeouts and max(timeouts) > start


def test_the_readme_installs_the_real_vllm_config_where_the_unit_reads_it() -> None:
    """docs/operations.md's install step copies configs/engines/vllm.toml (`vllm serve`, its workers
    adopted), not a made-up worker command, to the path in the unit's ExecStart; the
    token file it creates and the unit's RuntimeDirectory are the config's [api]."""
    readme = (REPO / "docs/operations.md").read_text()
    block = readme.split("## Privileges and installing under systemd")[1].split("```sh")[1]
    block = block.split("```")[0]
    installs = re.findall(r"^install -D -m 0644 (configs/\S+) (\S+)$", block, re.M)
    assert installs == [("configs/engines/vllm.toml", "/etc/placement-supervisor/config.toml")]
    source, target = installs[0]
    d = directives(UNIT.read_text())
    assert d["ExecStart"][0].split()[-1] == target
    config = load_config(str(REPO / source))
    assert config.engine is not None and config.engine.command[1] == "serve"
    assert config.engine.command[0].startswith("/opt/vllm/")  # the venv docs/operations.md makes
    assert config.workers.spawned_by == "engine"  # vLLM starts them; the supervisor adopts
    # The token the install step writes is the one the config reads; the socket is in
    # the directory systemd creates for the unit.
    assert config.api.token_file is not None
    assert f"> {config.api.token_file})" in block
    assert config.api.unix_socket == f"/run/{d['RuntimeDirectory'][0]}/api.sock"
    assert 2 * config.stop_timeout_s < float(d["TimeoutStopSec"][0])


def _sh_block(doc: str, heading: str) -> str:
    return doc.split(heading, 1)[1].split("```sh", 1)[1].split("```", 1)[0]


def test_uninstall_removes_what_install_creates() -> None:
    """Every path the install step creates (venv, link, config dir, unit file, the
    unit's StateDirectory) is removed by the uninstall step, after the service stops."""
    doc = (REPO / "docs/operations.md").read_text()
    install = _sh_block(doc, "## Privileges and installing under systemd")
    uninstall = _sh_block(doc, "### Uninstall")
    d = directives(UNIT.read_text())
    venv = re.findall(r"python3 -m venv (\S+) ", install)[0]
    link = re.findall(r"ln -s \S+/bin/(\S+) (\S+)/$", install, re.M)[0]
    created = {
        venv,
        f"{link[1]}/{link[0]}",
        "/etc/placement-supervisor",  # the config and token dir
        "/etc/systemd/system/" + UNIT.name,
        f"/var/lib/{d['StateDirectory'][0]}",
    }
    # Every file installed outside the config dir (the man page, the completion).
    installed = re.findall(r"^install -D -m 0644 \S+ (\S+)$", install, re.M)
    created |= {t for t in installed if not t.startswith("/etc/placement-supervisor/")}
    assert len(created) >= 7
    assert "/etc/placement-supervisor/config.toml" in install
    assert f"cp systemd/{UNIT.name} /etc/systemd/system/" in install
    removed = set(re.findall(r"^rm (?:-rf )?(\S+)", uninstall, re.M))
    removed |= set(re.findall(r"&& rm (?:-rf )?(\S+)", uninstall))
    assert created <= removed, sorted(created - removed)
    lines = uninstall.strip().splitlines()
    assert lines[0] == "systemctl disable --now placement-supervisor"  # a clean stop first
    assert d["ExecStart"][0].split()[0] == "/usr/local/bin/placement-supervisor"


def test_upgrade_checks_the_config_before_the_restart() -> None:
    doc = (REPO / "docs/operations.md").read_text()
    steps = _sh_block(doc, "### Upgrade").strip().splitlines()

    def first(prefix: str) -> int:
        return next(i for i, step in enumerate(steps) if step.startswith(prefix))

    plan, restart = first("placement-supervisor plan --config"), first("systemctl restart")
    reload = next(i for i, step in enumerate(steps) if "systemctl daemon-reload" in step)
    assert plan < reload < restart
    assert directives(UNIT.read_text())["ExecStart"][0].split()[-1] in steps[plan]
