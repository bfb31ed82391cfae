"""The session-end host check (tests/support/host_residue.py), run for real.

Each case runs a real pytest session with the check loaded, whose one test
leaves something behind (or puts it back), over a fixture host tree
(`--host-root`) and once over the real /run/placement-supervisor; the run
must fail, naming what differs, exactly when something was left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from supervisor.daemon.instance_lock import DEFAULT_RUNTIME_DIR

REPO = Path(__file__).resolve().parent.parent


def _host(root: Path) -> Path:
    """A host tree: two IRQs, an empty lock dir, a v1 cpuset and memory hierarchy."""
    for irq in (40, 41):
        (root / f"proc/irq/{irq}").mkdir(parents=True)
        (root / f"proc/irq/{irq}/smp_affinity_list").write_text("0-1\n")
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("4:memory:/job\n3:cpuset:/\n0::/\n")
    (root / "run/placement-supervisor").mkdir(parents=True)
    (root / "sys/fs/cgroup/cpuset").mkdir(parents=True)
    (root / "sys/fs/cgroup/memory/job").mkdir(parents=True)
    return root


def _session(tmp_path: Path, body: str, root: Path | None) -> subprocess.CompletedProcess[str]:
    test = tmp_path / "inner" / "test_inner.py"
    test.parent.mkdir()
    test.write_text(f"def test_inner():\n{textwrap.indent(textwrap.dedent(body), '    ')}")
    args = ["-p", "tests.support.host_residue", "-p", "no:cacheprovider", "-q", str(test)]
    # Its own base temp dir: pytest's default one cleans up old runs' dirs on start.
    args += ["--basetemp", str(tmp_path / "basetemp")]
    if root is not None:
        args += ["--host-root", str(root)]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=test.parent,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("body", "line"),
    [
        (
            "open(ROOT + '/proc/irq/41/smp_affinity_list', 'w').write('1\\n')",
            "/proc/irq/41/smp_affinity_list: 0-1 before the run, 1 after",
        ),
        (
            "open(ROOT + '/run/placement-supervisor/test-1.lock', 'w').write('1')",
            "/run/placement-supervisor/test-1.lock: left behind (absent before the run)",
        ),
        (
            "import os; os.mkdir(ROOT + '/sys/fs/cgroup/memory/job/placement-supervisor-t')",
            "/sys/fs/cgroup/memory/job/placement-supervisor-t: left behind",
        ),
        (
            "import os; os.mkdir(ROOT + '/sys/fs/cgroup/cpuset/ps-t-1')",
            "/sys/fs/cgroup/cpuset/ps-t-1: left behind",
        ),
    ],
    ids=["irq", "lock", "memory-cgroup", "cpuset"],
)
def test_a_run_that_leaves_something_fails_naming_it(tmp_path: Path, body: str, line: str) -> None:
    root = _host(tmp_path / "host")
    done = _session(tmp_path, f"ROOT = {str(root)!r}\n{body}\n", root)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    assert f"host check: {line}" in done.stdout, done.stdout


def test_a_run_that_puts_everything_back_passes(tmp_path: Path) -> None:
    root = _host(tmp_path / "host")
    body = f"""
    import os
    ROOT = {str(root)!r}
    irq = ROOT + '/proc/irq/40/smp_affinity_list'
    open(irq, 'w').write('1\\n')
    os.mkdir(ROOT + '/sys/fs/cgroup/cpuset/ps-t-1')
    open(ROOT + '/run/placement-supervisor/t.lock', 'w').write('1')
    open(irq, 'w').write('0-1\\n')
    os.rmdir(ROOT + '/sys/fs/cgroup/cpuset/ps-t-1')
    os.unlink(ROOT + '/run/placement-supervisor/t.lock')
    """
    done = _session(tmp_path, body, root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "host check" not in done.stdout


def test_a_lock_file_left_in_the_real_lock_dir_fails_the_run(
    tmp_path: Path, need_root: None
) -> None:
    made = not os.path.isdir(DEFAULT_RUNTIME_DIR)
    lock = Path(DEFAULT_RUNTIME_DIR) / f"host-check-{os.getpid()}.lock"
    body = f"""
    import os
    os.makedirs({DEFAULT_RUNTIME_DIR!r}, exist_ok=True)
    open({str(lock)!r}, 'w').write(str(os.getpid()))
    """
    try:
        done = _session(tmp_path, body, None)
    finally:
        lock.unlink(missing_ok=True)
        if made:
            os.rmdir(DEFAULT_RUNTIME_DIR)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"host check: {lock}: left behind" in done.stdout, done.stdout
