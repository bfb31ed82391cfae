"""Issue 16 item 5: what `plan --config` says "ok" to, `run` starts; what it refuses, `run` does.

Each case is a real config file checked by a real `python -m supervisor plan
--config F` and refused by a real `run --config F` (exit 2, one line each,
nothing spawned), with a real account (`nobody`), real file modes, a real
interpreter and the kernel's real argument limits; the instance lock is a
real file in a runtime dir of the test's own.
"""

from __future__ import annotations

import errno
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

from supervisor.daemon.preflight import arg_limits, check_arg_size, python_module, user_can
from supervisor.run.users import resolve_account
from tests.support.daemon_support import (
    DaemonProcess,
    daemon_env,
    free_port,
    run_supervisor,
    to_toml,
)
from tests.support.poll import poll

NOBODY = pwd.getpwnam("nobody")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="becoming `nobody` needs root")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory anyone may search (pytest's tmp_path is root's, mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="ps-preflight-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config_file(tmp_path: Path, workers: dict[str, Any], **top: Any) -> Path:
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "workers": workers,
        "placement": {"engine": {"enabled": False}, "rank_roles": {}},
        **top,
    }
    path = tmp_path / "c.toml"
    path.write_text(to_toml(doc))
    return path


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    return daemon_env(RUNTIME_DIRECTORY=str(tmp_path / "run"), **extra)


def errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if line.startswith("placement-supervisor:")]


def plan_and_run(config: Path, env: dict[str, str]) -> tuple[list[str], list[str]]:
    """The error lines of `plan --config` and of `run --config` (both must exit 2)."""
    planned = run_supervisor("plan", "--config", str(config), env=env, timeout_s=120)
    assert planned.returncode == 2, planned.stderr
    ran = run_supervisor(
        "run",
        "--config",
        str(config),
        "--listen",
        f"127.0.0.1:{free_port()}",
        env=env,
        timeout_s=120,
    )
    assert ran.returncode == 2, ran.stderr[-2000:]
    assert "spawn" not in ran.stderr  # refused before anything started
    return errors(planned), errors(ran)


def lock_files(tmp_path: Path) -> list[str]:
    run_dir = tmp_path / "run"
    return sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []


# -- a command the configured user cannot execute ----------------------------------


@as_root
def test_a_command_only_root_may_execute_is_refused_for_nobody(
    tmp_path: Path, shared_dir: Path
) -> None:
    engine = shared_dir / "engine"
    shutil.copy("/bin/true", engine)
    engine.chmod(0o700)  # root's own: nobody gets EACCES, the shim exits 126
    config = config_file(tmp_path, {"command": [str(engine)], "user": "nobody"})
    planned, ran = plan_and_run(config, env_for(tmp_path))
    want = (
        f"placement-supervisor: error: {config}: workers.command: {engine} is not executable "
        f"by user 'nobody' (uid {NOBODY.pw_uid}): the file's or a directory's permissions "
        "above it refuse it (execve EACCES, exit 126)"
    )
    assert planned == ran == [want]
    assert lock_files(tmp_path) == []


@as_root
def test_an_interpreter_in_a_directory_nobody_may_not_search_is_refused(
    tmp_path: Path, shared_dir: Path
) -> None:
    # The file itself is 0755, but it lies under a 0700 directory (a venv in
    # root's home): execve walks every directory's search permission.
    private = shared_dir / "root-home"
    (private / "bin").mkdir(parents=True)
    python = private / "bin" / "python3"
    python.symlink_to(os.path.realpath(sys.executable))
    private.chmod(0o700)
    config = config_file(tmp_path, {"command": [str(python), "-c", "pass"], "user": "nobody"})
    planned, ran = plan_and_run(config, env_for(tmp_path))
    assert planned == ran
    assert len(planned) == 1 and f"{python} is not executable by user 'nobody'" in planned[0]
    # The same command as root passes (nothing else in the config is wrong).
    config_file(tmp_path, {"command": [str(python), "-c", "pass"]})
    done = run_supervisor("plan", "--config", str(config), env=env_for(tmp_path), timeout_s=120)
    assert (done.returncode, errors(done)) == (0, [])


@as_root
def test_a_script_whose_interpreter_nobody_cannot_execute_is_refused(shared_dir: Path) -> None:
    interpreter = shared_dir / "interp"
    shutil.copy("/bin/sh", interpreter)
    interpreter.chmod(0o700)
    script = shared_dir / "engine.sh"
    script.write_text(f"#!{interpreter}\nexit 0\n")
    script.chmod(0o755)
    account = resolve_account("nobody", None, "c.toml: workers")
    assert user_can(str(script), os.X_OK, account) is True  # the script alone would pass
    config = config_file(shared_dir, {"command": [str(script)], "user": "nobody"})
    done = run_supervisor("plan", "--config", str(config), env=daemon_env(), timeout_s=120)
    assert done.returncode == 2
    assert errors(done) == [
        f"placement-supervisor: error: {config}: workers.command: {script}: its interpreter "
        f"{interpreter} is not executable by user 'nobody' (uid {NOBODY.pw_uid})"
    ]


# -- python -m pkg.sub ----------------------------------------------------------


def test_a_missing_submodule_is_refused_though_its_package_exists(tmp_path: Path) -> None:
    config = config_file(tmp_path, {"command": ["python", "-m", "supervisor.demo.no_such_worker"]})
    planned, ran = plan_and_run(config, env_for(tmp_path))
    assert (
        planned
        == ran
        == [
            f"placement-supervisor: error: {config}: workers.command: `python -m "
            f"supervisor.demo.no_such_worker`: {sys.executable} has no module "
            "'supervisor.demo.no_such_worker'"
        ]
    )


def test_a_package_without_main_and_another_interpreters_modules(tmp_path: Path) -> None:
    # `-m supervisor.demo` is a package with no __main__: Python refuses to run it.
    config = config_file(tmp_path, {"command": ["python", "-m", "supervisor.demo"]})
    done = run_supervisor("plan", "--config", str(config), env=env_for(tmp_path), timeout_s=120)
    assert done.returncode == 2
    assert errors(done)[0].endswith("has no module 'supervisor.demo.__main__'")
    # Another interpreter (the system's, without this venv's aiohttp) is asked itself.
    system = shutil.which("python3", path="/usr/bin:/bin")
    assert system is not None
    probe = subprocess.run([system, "-c", "import aiohttp"], capture_output=True, check=False)
    if probe.returncode == 0:
        pytest.skip(f"{system} has aiohttp too")
    config = config_file(tmp_path, {"command": [system, "-m", "aiohttp.web"]})
    done = run_supervisor("plan", "--config", str(config), env=env_for(tmp_path), timeout_s=120)
    assert done.returncode == 2
    assert errors(done) == [
        f"placement-supervisor: error: {config}: workers.command: `{system} -m aiohttp.web`: "
        f"{system} has no module 'aiohttp'"
    ]
    config = config_file(tmp_path, {"command": [sys.executable, "-m", "aiohttp.web"]})
    done = run_supervisor("plan", "--config", str(config), env=env_for(tmp_path), timeout_s=120)
    assert (done.returncode, errors(done)) == (0, [])


def test_present_submodules_pass_without_running_their_package(tmp_path: Path) -> None:
    # The walk over __path__ finds pkg.sub without executing pkg/__init__.py.
    pkg = tmp_path / "lib" / "noisy_pkg"
    pkg.mkdir(parents=True)
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "serve.py").write_text("")
    config = config_file(
        tmp_path,
        {"command": ["python", "-m", "noisy_pkg.serve"], "env": {"PYTHONPATH": str(pkg.parent)}},
    )
    done = run_supervisor("plan", "--config", str(config), env=env_for(tmp_path), timeout_s=120)
    assert (done.returncode, errors(done)) == (0, [])
    assert not marker.exists()


def test_python_module_reads_options_before_m() -> None:
    assert python_module(["python", "-u", "-X", "dev", "-m", "a.b", "--x"]) == "a.b"
    assert python_module(["python", "-ma.b"]) == "a.b"
    assert python_module(["python", "-c", "pass", "-m", "x"]) is None
    assert python_module(["python", "script.py", "-m", "x"]) is None


# -- environment names, ready.http: refused when the config loads ---------------------


def test_a_visible_devices_env_that_is_no_variable_name_is_a_config_error(tmp_path: Path) -> None:
    config = config_file(tmp_path, {"command": ["sleep", "600"]}, visible_devices_env="A=B")
    planned, ran = plan_and_run(config, env_for(tmp_path))
    want = (
        f"placement-supervisor: error: {config}: visible_devices_env: bad variable name "
        "'A=B': empty, or holds '=' or a NUL"
    )
    assert planned == ran == [want]


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://[::1", "not a URL (Invalid IPv6 URL)"),
        ("http://127.0.0.1:99999/health", "not a URL (Port out of range 0-65535)"),
        ("http://127.0.0.1:port/health", "not a URL (Port could not be cast to integer value"),
        ("http://:8000/health", "no host in"),
    ],
)
def test_a_ready_http_url_that_cannot_be_dialled_is_a_config_error(
    tmp_path: Path, url: str, why: str
) -> None:
    config = config_file(
        tmp_path,
        {"command": ["sleep", "600"]},
        engine={"command": ["sleep", "600"]},
        ready={"http": url},
        placement={"rank_roles": {}},
    )
    planned, ran = plan_and_run(config, env_for(tmp_path))
    assert planned == ran and len(planned) == 1
    assert planned[0].startswith(f"placement-supervisor: error: {config}: ready.http: {why}")


# -- the kernel's argument limits -----------------------------------------------


def test_a_variable_over_max_arg_strlen_is_refused(tmp_path: Path) -> None:
    per_string, _ = arg_limits()
    config = config_file(tmp_path, {"command": ["sleep", "600"], "env": {"BIG": "x" * per_string}})
    planned, ran = plan_and_run(config, env_for(tmp_path))
    want = (
        f"placement-supervisor: error: {config}: workers (rank 0): 'BIG' is "
        f"{per_string + 5} bytes, over the kernel's {per_string} per argument or variable "
        "(MAX_ARG_STRLEN; execve E2BIG, 'Argument list too long')"
    )
    assert planned == ran == [want]
    assert lock_files(tmp_path) == []  # refused inside the lock: its file went with it


def test_an_environment_over_arg_max_in_all_is_refused(tmp_path: Path) -> None:
    # Each part passes alone (the operator's environment started the supervisor,
    # the config is under its 1 MiB cap); the worker gets both, over ARG_MAX.
    per_string, total = arg_limits()
    chunk = per_string // 2
    from_config = {f"CONF{i}": "x" * chunk for i in range(12)}  # ~786 KB of TOML
    operator = {f"OPER{i}": "x" * chunk for i in range((total - 12 * chunk) // chunk + 2)}
    config = config_file(tmp_path, {"command": ["sleep", "600"], "env": from_config})
    planned, ran = plan_and_run(config, env_for(tmp_path, **operator))
    assert planned == ran and len(planned) == 1
    assert "workers (rank 0): its arguments and environment are " in planned[0]
    assert f"over the kernel's {total} (ARG_MAX" in planned[0]


def test_check_arg_size_agrees_with_the_kernel(tmp_path: Path) -> None:
    # What the check says passes, execve takes; what it refuses, execve refuses (E2BIG).
    limits = arg_limits()
    per_string, _ = limits
    for size in (per_string - 200, per_string + 1):
        env = {"PATH": "/usr/bin:/bin", "V": "x" * size}
        verdict = check_arg_size("w", ["/bin/true"], env, limits)
        try:
            subprocess.run(["/bin/true"], env=env, check=True)
            errno_seen = 0
        except OSError as err:
            errno_seen = err.errno or -1
        assert errno_seen in (0, errno.E2BIG)
        started = errno_seen == 0
        assert (verdict is None) == started, (size, verdict)


# -- PLACEMENT_SUPERVISOR_INSTANCE ------------------------------------------------


@pytest.mark.parametrize("instance", ["svc\nb", "../x", ".hidden", "a b"])
def test_an_instance_name_that_cannot_name_a_cgroup_is_refused(
    tmp_path: Path, instance: str
) -> None:
    config = config_file(tmp_path, {"command": ["sleep", "600"]})
    planned, ran = plan_and_run(config, env_for(tmp_path, PLACEMENT_SUPERVISOR_INSTANCE=instance))
    assert planned == ran and len(planned) == 1
    assert planned[0].startswith(
        f"placement-supervisor: error: PLACEMENT_SUPERVISOR_INSTANCE={instance!r}: "
    )
    assert lock_files(tmp_path) == []


# -- the instance lock's file ------------------------------------------------------


def test_no_lock_file_is_left_after_an_exit_2_or_3(tmp_path: Path) -> None:
    # An unknown user (exit 2) and no accelerator of the configured kind (exit 3):
    # the lock file went with the refusal either way.
    unknown = config_file(tmp_path, {"command": ["sleep", "600"], "user": "no-such-user-ps"})
    done = run_supervisor("run", "--config", str(unknown), env=env_for(tmp_path), timeout_s=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert lock_files(tmp_path) == []
    infeasible = config_file(tmp_path, {"command": ["sleep", "600"]}, accelerator="nvidia")
    if run_supervisor("plan", "--config", str(infeasible), env=env_for(tmp_path)).returncode != 3:
        pytest.skip("this host has NVIDIA GPUs: the plan is feasible")
    done = run_supervisor("run", "--config", str(infeasible), env=env_for(tmp_path), timeout_s=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert lock_files(tmp_path) == []


@pytest.mark.parametrize("holder", ["dead", "another program"])
def test_a_stale_lock_file_is_taken_over_with_one_log_line(tmp_path: Path, holder: str) -> None:
    # What a KILLed or HUPed daemon leaves: its pid in a file nobody holds an flock on.
    if holder == "dead":
        gone = subprocess.Popen(["true"])
        gone.wait()
        pid = gone.pid
    else:
        pid = os.getpid()  # alive, and not a daemon of this config
    per_string, _ = arg_limits()
    too_big = {"command": ["sleep", "600"], "env": {"BIG": "x" * per_string}}
    config = config_file(tmp_path, too_big)
    env = env_for(tmp_path, PLACEMENT_SUPERVISOR_INSTANCE="stale-test")
    (tmp_path / "run").mkdir(mode=0o700)
    stale = tmp_path / "run" / "stale-test.lock"
    stale.write_text(f"{pid}\n")
    # The argv/env size check refuses inside the lock (exit 2): taken over, then removed.
    done = run_supervisor("run", "--config", str(config), env=env, timeout_s=120)
    assert done.returncode == 2, done.stderr[-2000:]
    taken = [line for line in done.stderr.splitlines() if "instance lock stale" in line]
    alive = "no" if holder == "dead" else '"yes (another process: it holds no lock)"'
    assert len(taken) == 1, done.stderr[-2000:]
    assert taken[0].endswith(
        f'INFO instance lock stale path={stale} pid={pid} pid_alive={alive} action="take over"'
    )
    assert lock_files(tmp_path) == []


def test_a_daemon_killed_leaves_a_file_the_next_start_takes_over(tmp_path: Path) -> None:
    config = config_file(tmp_path, {"command": ["sleep", "600"]})
    env = env_for(tmp_path, PLACEMENT_SUPERVISOR_INSTANCE="kill-test")
    lock = tmp_path / "run" / "kill-test.lock"
    with DaemonProcess(config, tmp_path / "first.log", env=env) as first:
        poll(first.running, timeout_s=60)
        # SIGKILL: no handler runs (a HUP is a reload now, tests/daemon/test_reload_daemon.py).
        first.proc.send_signal(signal.SIGKILL)
        assert first.proc.wait(timeout=20) == -signal.SIGKILL
    assert lock.read_text() == f"{first.pid}\n"  # left behind, holding no lock
    with DaemonProcess(config, tmp_path / "second.log", env=env) as second:
        poll(second.running, timeout_s=60)
        taken = [line for line in second.tail().splitlines() if "instance lock stale" in line]
        assert len(taken) == 1 and f"path={lock} pid={first.pid} pid_alive=no" in taken[0]
        assert lock.read_text() == f"{second.pid}\n"
        assert second.stop() == 0
    assert lock_files(tmp_path) == []
