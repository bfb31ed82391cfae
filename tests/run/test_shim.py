"""The exec shim: a real child bound before its first instruction, its report, its failures."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.bind.report import ShimReport, ShimReportError, parse_shim_report, shim_argv
from supervisor.cpulist import parse_cpulist
from supervisor.errors import reason_of_errno
from supervisor.run.shim import to_json
from tests.support.children import mems_allowed, read_all, start_shimmed
from tests.support.poll import wait_until

# The child's very first action: print what the kernel says about itself.
PROBE = r"""
import os, sys
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
policy = open("/proc/self/numa_maps").readline().split()[1]
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
print(status["Cpus_allowed_list"].strip(), status["Mems_allowed_list"].strip(), policy,
      ",".join(map(str, fds)), flush=True)
"""


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def launch(
    cpus: Sequence[int],
    mems: Sequence[int],
    command: Sequence[str],
    *,
    isolated: bool = True,
    **kwargs: object,
) -> tuple[subprocess.CompletedProcess[str], ShimReport]:
    proc, report = start_shimmed(
        cpus,
        mems,
        command,
        shim={"isolated": isolated, **kwargs},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), report


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "module"])
def test_child_starts_bound(isolated: bool) -> None:
    cpu = allowed_cpus()[-1]
    node = min(mems_allowed())
    done, report = launch([cpu], [node], [sys.executable, "-c", PROBE], isolated=isolated)
    assert done.returncode == 0, done.stderr
    cpus, mems, policy, fds = done.stdout.split()
    assert parse_cpulist(cpus) == {cpu}
    assert policy == f"bind:{node}"  # MPOL_BIND inherited across execve
    # The report fd is close-on-exec: the worker never sees it.
    assert [int(f) for f in fds.split(",")][:3] == [0, 1, 2]
    assert len(fds.split(",")) <= 4  # 0-2 and the fd listing itself
    assert mems  # Mems_allowed is the cpuset's, unchanged by a policy
    assert report.cpus == (cpu,)
    assert report.mems == (node,)
    assert report.mempolicy == "bind"
    assert report.reason is None
    assert not report.degraded
    assert report.exec_error is None


def test_signals_are_not_left_ignored_by_the_shims_python() -> None:
    # CPython ignores SIGPIPE (13) and SIGXFSZ (25); a worker must not inherit that.
    done, _ = launch(allowed_cpus(), [], ["cat", "/proc/self/status"], mempolicy="none")
    sig_ign = next(x for x in done.stdout.splitlines() if x.startswith("SigIgn:"))
    assert int(sig_ign.split()[1], 16) & ((1 << 12) | (1 << 24)) == 0


def test_report_fd_reaches_eof_at_exec_while_the_worker_runs() -> None:
    r, w = os.pipe()
    argv = shim_argv(
        sys.executable,
        allowed_cpus(),
        [min(mems_allowed())],
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        report_fd=w,
    )
    proc = subprocess.Popen(argv, pass_fds=[w], stdin=subprocess.PIPE)
    os.close(w)
    try:
        report = parse_shim_report(read_all(r))  # returns at exec, not at exit
        assert proc.poll() is None
        assert report.mempolicy == "bind"
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    assert proc.returncode == 0


@pytest.mark.parametrize("policy", ["preferred", "none"])
def test_mempolicy_can_be_weaker(policy: str) -> None:
    node = min(mems_allowed())
    done, report = launch(allowed_cpus(), [node], [sys.executable, "-c", PROBE], mempolicy=policy)
    assert done.returncode == 0, done.stderr
    shown = done.stdout.split()[2]
    assert shown == ("prefer:" + str(node) if policy == "preferred" else "default")
    assert report.mempolicy == policy
    assert report.reason is None


def test_bind_failure_falls_down_the_ladder_and_still_execs() -> None:
    outside = max(mems_allowed()) + 1  # not in Mems_allowed: MPOL_BIND gets EINVAL
    done, report = launch(allowed_cpus(), [outside], [sys.executable, "-c", PROBE])
    assert done.returncode == 0, done.stderr
    assert report.mempolicy in ("preferred", "none")
    assert report.reason is not None
    assert "bind failed" in report.reason
    assert "EINVAL" in report.reason
    assert report.degraded
    shown = done.stdout.split()[2]
    assert shown == ("default" if report.mempolicy == "none" else f"prefer:{outside}")
    # The number, not the text, is what the supervisor maps to a reason.
    assert report.mempolicy_errno == errno.EINVAL
    assert reason_of_errno(report.mempolicy_errno) == "invalid"


def test_refusals_are_reported_as_errno_numbers(tmp_path: Path) -> None:
    missing_cpu = max(allowed_cpus()) + 64  # no such CPU: sched_setaffinity gets EINVAL
    not_a_cgroup = tmp_path / "no-such-cgroup"  # cgroup.procs cannot be opened: ENOENT
    done, report = launch(
        [missing_cpu],
        [min(mems_allowed())],
        [sys.executable, "-c", PROBE],
        cgroups=[str(not_a_cgroup)],
    )
    assert done.returncode == 0, done.stderr
    assert report.affinity_errno == errno.EINVAL and "EINVAL" in (report.affinity_error or "")
    assert report.cgroup_errnos == (errno.ENOENT,) and len(report.cgroup_errors) == 1
    assert report.mempolicy_errno is None
    assert [reason_of_errno(n) for n in (report.affinity_errno, *report.cgroup_errnos)] == [
        "invalid",
        "gone",
    ]


def test_missing_command_exits_127_with_a_report() -> None:
    done, report = launch(allowed_cpus(), [min(mems_allowed())], ["no-such-command-xyz"])
    assert done.returncode == 127
    assert report.exec_failed
    assert report.errno == "ENOENT"
    assert report.exec_error is not None
    assert "no-such-command-xyz" in report.exec_error
    assert report.mempolicy == "bind"  # the binding report came first
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "cannot execute 'no-such-command-xyz'" in lines[0]
    assert "Traceback" not in done.stderr


def test_not_executable_exits_126(tmp_path: Path) -> None:
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    done, report = launch(allowed_cpus(), [min(mems_allowed())], [str(script)])
    assert done.returncode == 126
    assert report.errno == "EACCES"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpus", "0-x", "--", "true"], "--cpus: bad list"),
        (["--cpus", "3-1", "--", "true"], "bad range"),
        (["--bogus", "--", "true"], "unknown argument"),
        (["--cpus", "0"], "no command"),
        (["--mempolicy", "strict", "--", "true"], "--mempolicy"),
        (["--pdeathsig", "USR1", "--", "true"], "--pdeathsig"),
        (["--report-fd", "987", "--", "true"], "--report-fd 987"),
        (["--cpus"], "expected a value"),
        (["--uid", "65534", "--", "true"], "--uid and --gid go together"),
        (["--groups", "1", "--", "true"], "--groups needs --uid and --gid"),
        (["--uid", "nobody", "--gid", "1", "--", "true"], "--uid: expected a non-negative"),
    ],
)
def test_bad_arguments_exit_2(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.run.shim", *args],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


PDEATH_CHILD = r"""
import signal, sys, time
marker = sys.argv[1]
def on_term(signum, frame):
    open(marker, "w").write("TERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""

# An intermediate parent: starts the shim (which execs PDEATH_CHILD), prints the
# worker's pid, then waits to be SIGKILLed by the test.
MIDDLE = r"""
import os, subprocess, sys
from supervisor.bind.report import shim_argv
argv = shim_argv(sys.executable, sorted(os.sched_getaffinity(0)), [], sys.argv[2:],
                 parent_pid=os.getpid(), pdeathsig="TERM", mempolicy="none")
child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
sys.stdin.read()
"""


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.fixture
def reaped_pids() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_worker_gets_sigterm_when_its_parent_dies(tmp_path: Path, reaped_pids: list[int]) -> None:
    marker = tmp_path / "got-term"
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE, "x", sys.executable, "-c", PDEATH_CHILD, str(marker)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert middle.stdout is not None
    worker = int(middle.stdout.readline())
    reaped_pids.append(worker)
    assert pid_alive(worker)
    middle.kill()
    middle.wait()
    wait_until(lambda: not pid_alive(worker), 20, 0.02)
    assert not pid_alive(worker)
    assert marker.read_text() == "TERM"


def test_parent_already_gone_means_no_exec(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor.run.shim",
            "--pdeathsig",
            "TERM",
            "--parent-pid",
            "999999999",
            "--",
            "touch",
            str(marker),
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == -signal.SIGTERM
    assert "parent 999999999 exited" in done.stderr
    assert not marker.exists()


def test_shim_argv_shape() -> None:
    argv = shim_argv(
        "/py",
        [3, 1, 2],
        [1],
        ["w", "--x"],
        cgroups=["/cg/a", "/cg/b"],
        report_fd=7,
        parent_pid=42,
        name="rank0",
    )
    assert argv[:4] == ["/py", "-I", "-S", "-c"]
    tail = argv[5:]
    assert tail == [
        "--cpus",
        "1,2,3",
        "--mems",
        "1",
        "--mempolicy",
        "bind",
        "--cgroup",
        "/cg/a",
        "--cgroup",
        "/cg/b",
        "--pdeathsig",
        "TERM",
        "--parent-pid",
        "42",
        "--report-fd",
        "7",
        "--name",
        "rank0",
        "--",
        "w",
        "--x",
    ]
    module = shim_argv("/py", [0], [0], ["w"], isolated=False, pdeathsig="none")
    assert module[:3] == ["/py", "-m", "supervisor.run.shim"]
    assert "--pdeathsig" not in module
    as_user = shim_argv("/py", [0], [0], ["w"], user=(65534, 65534, (65534, 44)))
    assert as_user[-8:] == ["--uid", "65534", "--gid", "65534", "--groups", "44,65534", "--", "w"]
    with pytest.raises(ValueError, match="mempolicy"):
        shim_argv("/py", [0], [0], ["w"], mempolicy="strict")
    with pytest.raises(ValueError, match="empty"):
        shim_argv("/py", [0], [0], [])


def test_parse_shim_report_rejects_garbage() -> None:
    with pytest.raises(ShimReportError, match="empty"):
        parse_shim_report(b"")
    with pytest.raises(ShimReportError, match="not JSON"):
        parse_shim_report(b"{nope\n")
    with pytest.raises(ShimReportError, match="mempolicy"):
        parse_shim_report(b'{"cpus":[0],"mems":[],"mempolicy":"weird"}\n')
    with pytest.raises(ShimReportError, match="cpus"):
        parse_shim_report(b'{"cpus":["a"],"mems":[],"mempolicy":"none"}\n')


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(json_values)
def test_hand_written_json_round_trips(value: object) -> None:
    text = to_json(value)
    assert text.isascii()
    assert json.loads(text) == value
