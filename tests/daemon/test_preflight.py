"""`plan --config` checks what `run` would fail on, one message each; exit codes of `run`.

Real files, real PATH lookups, real sockets: a port is taken by a socket this
test listens on, a token file has the mode the test gives it.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.daemon.preflight import check_command, check_port_free, check_token_file
from tests.support.daemon_support import daemon_env, free_port, run_supervisor, to_toml


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another program (this test) listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def token(tmp_path: Path, mode: int, text: str = "s3cret\n") -> Path:
    path = tmp_path / f"token-{mode:o}"
    path.write_text(text)
    path.chmod(mode)
    return path


def good_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "engine": {"command": ["sleep", "600"]},
        "workers": {"command": ["python", "-m", "supervisor.demo.worker", "--rank", "{rank}"]},
        "ready": {"tcp": f"127.0.0.1:{free_port()}", "timeout_s": 600},
        "api": {
            "listen": f"127.0.0.1:{free_port()}",
            "token_file": str(token(tmp_path, 0o600)),
        },
        "placement": {"rank_roles": {}},
    }
    for key, value in extra.items():
        doc[key] = {**doc[key], **value} if isinstance(value, dict) else value
    return doc


def plan(tmp_path: Path, doc: dict[str, Any], *args: str) -> tuple[int, list[str], Path]:
    config = tmp_path / "c.toml"
    config.write_text(to_toml(doc))
    env = daemon_env(PATH="/usr/local/bin:/usr/bin:/bin")
    done = run_supervisor("plan", "--config", str(config), *args, env=env, timeout_s=120)
    assert "Traceback" not in done.stderr
    assert "plan" in done.stdout or "rank" in done.stdout  # the plan is printed either way
    return done.returncode, done.stderr.strip().splitlines(), config


def test_a_config_that_would_run_passes(tmp_path: Path) -> None:
    code, errors, _ = plan(tmp_path, good_config(tmp_path))
    assert (code, errors) == (0, [])


def test_workers_the_engine_spawns_have_no_command_to_check(tmp_path: Path) -> None:
    # spawned_by = "engine": [workers] has no command; only the engine's is checked.
    doc = good_config(tmp_path)
    doc["workers"] = {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]}
    code, errors, _ = plan(tmp_path, doc)
    assert (code, errors) == (0, [])


def test_every_problem_is_one_message_and_exit_2(tmp_path: Path, taken_port: int) -> None:
    doc = good_config(
        tmp_path,
        engine={"command": ["no-such-engine-ps", "serve"], "user": "no-such-user-ps"},
        workers={"command": ["python3", "-m", "no_such_module_ps.worker"]},
        ready={"tcp": f"127.0.0.1:{taken_port}"},
        api={"token_file": str(token(tmp_path, 0o644))},
    )
    code, errors, config = plan(tmp_path, doc)
    assert code == 2
    prefix = f"placement-supervisor: error: {config}: "
    assert errors == [
        prefix + "engine.command: 'no-such-engine-ps' is not found on PATH "
        "(/usr/local/bin:/usr/bin:/bin)",
        prefix + "engine.user: no such user 'no-such-user-ps' on this host",
        prefix + "workers.command: `python3 -m no_such_module_ps.worker` runs under the "
        f"supervisor's own interpreter ({sys.executable}), which has no module "
        "'no_such_module_ps'; name the engine environment's interpreter instead "
        "(e.g. /opt/no_such_module_ps/bin/python)",
        prefix + f"api.token_file: {tmp_path}/token-644 is readable by others (mode 0644); "
        f"chmod 600 {tmp_path}/token-644",
        prefix + "ready.tcp (the engine must be the one to listen there): "
        f"127.0.0.1:{taken_port} is already in use by another program",
    ]
    # Skipped on request (a host where the service runs and holds its ports) ...
    assert plan(tmp_path, doc, "--no-checks")[:2] == (0, [])


def test_the_api_port_is_checked_too(tmp_path: Path, taken_port: int) -> None:
    doc = good_config(tmp_path, api={"listen": f"127.0.0.1:{taken_port}"})
    code, errors, config = plan(tmp_path, doc)
    assert code == 2
    assert errors == [
        f"placement-supervisor: error: {config}: api.listen: "
        f"127.0.0.1:{taken_port} is already in use by another program"
    ]


def test_checks_one_by_one(tmp_path: Path) -> None:
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    script = tmp_path / "engine"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    assert check_command("w", ["sleep"], env, sys.executable) is None
    assert check_command("w", [str(script)], env, sys.executable) == (
        f"w: {script} is not an executable file"
    )
    assert check_command("w", [str(tmp_path / "absent")], env, sys.executable) == (
        f"w: {str(tmp_path / 'absent')!r} does not exist"
    )
    # `python` is the supervisor's interpreter: the module must be importable by it.
    assert (
        check_command("w", ["python", "-m", "supervisor.demo.worker"], {}, sys.executable) is None
    )
    assert check_command("w", ["{rank}.sh"], env, sys.executable) is None  # filled per rank
    script.chmod(0o755)
    assert check_command("w", ["engine"], env, sys.executable) is None  # found on PATH

    assert check_token_file("t", str(token(tmp_path, 0o600))) is None
    assert check_token_file("t", str(token(tmp_path, 0o640))) is not None
    empty = token(tmp_path, 0o400, "\n")
    assert check_token_file("t", str(empty)) == f"t: {empty} is empty"
    missing = check_token_file("t", str(tmp_path / "none"))
    assert missing == f"t: {tmp_path / 'none'}: cannot read: No such file or directory"

    assert check_port_free("p", "127.0.0.1", free_port()) is None
    assert check_port_free("p", "127.0.0.1", 0) is None


@pytest.mark.parametrize("listener", ["tcp", "unix"])
def test_run_exits_2_when_the_api_cannot_listen(tmp_path: Path, listener: str) -> None:
    # Exit 1 would make Restart=on-failure retry every 5 s forever; 2 stops it.
    doc = {"workers": {"command": ["sleep", "600"]}, "placement": {"engine": {"enabled": False}}}
    config = tmp_path / "c.toml"
    config.write_text(to_toml(doc))
    with contextlib.ExitStack() as stack:
        if listener == "tcp":
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            listen = f"127.0.0.1:{sock.getsockname()[1]}"
        else:
            path = tmp_path / "not-a-socket"
            path.write_text("")
            listen = f"unix:{path}"
        done = run_supervisor(
            "run", "--config", str(config), "--listen", listen, env=daemon_env(), timeout_s=120
        )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("placement-supervisor: error: ")
    assert ("already in use" if listener == "tcp" else "not a socket") in last
