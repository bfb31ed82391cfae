"""`pytest -n N` (.ci/test) keeps a module's tests on one worker, in order, and the
modules of a shared group (tests/support/xdist_groups.py) on one worker: run for
real, with pytest-xdist, over a small suite laid out with the real suite's paths."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.daemon_support import REPO
from tests.support.xdist_groups import SHARED, scope_of

CONFTEST = """
from tests.support.xdist_groups import make_scheduler

def pytest_xdist_make_scheduler(config, log):
    return make_scheduler(config, log)
"""

# Each test records the worker it ran on; the second test of a module needs the
# first's module fixture state, as tests/serve/test_progress.py's do.
MODULE = """
import json, os, pytest

@pytest.fixture(scope="module")
def state():
    return []

{tests}
"""

TEST = """
def test_{i}(state):
    assert len(state) == {i}  # every earlier test of this module ran first, here
    state.append({i})
    with open({out!r}, "a") as f:
        f.write(json.dumps([__name__, {i}, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def test_a_module_is_its_own_scope_and_a_shared_group_one_scope() -> None:
    assert scope_of("tests/watch/test_fight.py::test_x[a-b]") == "tests/watch/test_fight.py"
    ray = [m for m, g in SHARED.items() if g == "ray"]
    assert len(ray) == 4 and {scope_of(f"{m}::test_x") for m in ray} == {"ray"}


def imported_names(path: Path) -> set[str]:
    """The names a module imports with `from ... import`."""
    tree = ast.parse(path.read_text())
    return {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def test_every_module_with_kubelet_parents_is_in_the_kubepods_group() -> None:
    """kubelet_parents removes the /kubepods parents it made, which another module's
    containers may be using: each module that makes them runs in one group."""
    users = {
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "kubelet_parents" in imported_names(p)
    }
    assert users, "no module uses kubelet_parents: this check checks nothing"
    assert {m: SHARED.get(m) for m in sorted(users)} == dict.fromkeys(sorted(users), "kubepods")


def test_modules_and_shared_groups_each_run_on_one_worker_in_order(tmp_path: Path) -> None:
    out = tmp_path / "ran.jsonl"
    modules = [*(m for m, g in SHARED.items() if g == "ray"), "tests/test_a.py", "tests/test_b.py"]
    for module in modules:
        path = tmp_path / module
        path.parent.mkdir(parents=True, exist_ok=True)
        tests = "".join(TEST.format(i=i, out=str(out)) for i in range(4))
        path.write_text(MODULE.format(tests=tests))
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    # Run from inside this suite's own xdist worker: none of its PYTEST_* settings,
    # and a base temp dir of its own (pytest's default one would clean up the old
    # runs' dirs under /tmp/pytest-of-<user>, example host trees and all).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"),
            *("--basetemp", str(tmp_path / "basetemp"), "tests"),
        ],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(ran) == 4 * len(modules)
    worker_of: dict[str, set[str]] = {}
    for module, _, worker in ran:
        worker_of.setdefault(module, set()).add(worker)
    assert all(len(w) == 1 for w in worker_of.values()), worker_of
    ray = {m.rsplit("/", 1)[1].removesuffix(".py") for m, g in SHARED.items() if g == "ray"}
    assert len({w for m, ws in worker_of.items() if m in ray for w in ws}) == 1, worker_of
    assert len({w for ws in worker_of.values() for w in ws}) > 1, worker_of  # spread
