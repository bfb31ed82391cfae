"""Shared pytest fixtures: where the repo is, and the test guest runner; the
session-end check that the run leaves the host as it found it
(tests/support/host_residue.py); the per-test check that no event loop
closed with its tasks still running (tests/support/leaked_tasks.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The session-end host check: IRQ affinities, the lock dir, the project's cgroups.
from tests.support.host_residue import (  # noqa: E402
    pytest_addoption,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_terminal_summary,
)
from tests.support.leaked_tasks import leaked_tasks  # noqa: E402

__all__ = [
    "pytest_addoption",
    "pytest_sessionfinish",
    "pytest_sessionstart",
    "pytest_terminal_summary",
]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def example_root(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The named example host (supervisor.examples), built once per session:
    `example_root("dgx-h100")` is its tree's root. Tests read it, never write it."""
    from supervisor.examples.catalogue import find_example  # noqa: PLC0415

    built: dict[str, Path] = {}

    def root(name: str) -> Path:
        if name not in built:
            built[name] = find_example(name).build(tmp_path_factory.mktemp(f"example-{name}"))
        return built[name]

    return root


@pytest.fixture
def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (cgroups, /proc/irq, other processes' affinity)")


@pytest.fixture(scope="session", autouse=True)
def _runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Daemons the tests start keep their instance lock in the session's own dir
    (systemd's RUNTIME_DIRECTORY, which every daemon reads first), not the host's
    /run/placement-supervisor: a daemon a test SIGKILLs leaves its lock file by
    design (the next start takes it over), and the session-end check wants that
    dir as the run found it. Tests that set RUNTIME_DIRECTORY themselves keep theirs."""
    old = os.environ.get("RUNTIME_DIRECTORY")
    os.environ["RUNTIME_DIRECTORY"] = str(tmp_path_factory.mktemp("run"))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RUNTIME_DIRECTORY", None)
        else:
            os.environ["RUNTIME_DIRECTORY"] = old


@pytest.fixture(scope="session", autouse=True)
def _remove_test_cgroups() -> Iterator[None]:
    """Daemons started by tests use the instance `test-<pid>` (daemon_env); one
    that a test SIGKILLs cannot remove its cgroup dirs, so the session does."""
    yield
    from tests.support.cgroup_v1 import V1_CPUSET, V1_MEMORY, own_memory_cgroup, remove_v1_tree  # noqa: PLC0415

    name = f"placement-supervisor-test-{os.getpid()}"
    memory = own_memory_cgroup()
    for parent, hierarchy in ((V1_CPUSET, V1_CPUSET), (memory, V1_MEMORY)):
        if parent is not None and (parent / name).exists():
            remove_v1_tree(parent / name, hierarchy)


@pytest.fixture(autouse=True)
def _no_leaked_tasks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test whose event loops closed with tasks still running
    (tests/support/leaked_tasks.py), unless it is marked `leaks_tasks`."""
    with leaked_tasks() as found:
        yield
    if found and request.node.get_closest_marker("leaks_tasks") is None:
        pytest.fail("an event loop closed with tasks still running: " + "; ".join(found))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`pytest -n N` (.ci/test): whole modules to a worker, the slowest first, the
    modules that share a host-wide resource on one worker (tests/support/xdist_groups.py)."""
    from tests.support.xdist_groups import make_scheduler  # noqa: PLC0415

    return make_scheduler(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """In CI (`CI` set, as .ci/run is run) a skip is a failure.

    Tests skip where this machine lacks something (root, a second CPU, the
    test guest, prometheus); CI runs on a machine that has it all, so a
    skip there means the test silently proved nothing.
    """
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every test must run: {reason}"
