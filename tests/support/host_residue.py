"""The session-end check: the test run leaves the host as it found it.

Does I/O (reads only): before the first test and after the last, every
`/proc/irq/<n>/smp_affinity_list`, the instance lock dir
`/run/placement-supervisor` and this project's cgroup dirs (named
`placement-supervisor*` or the tests' `ps-*`, below each hierarchy's root and
below this process's own cgroup) are read; when anything differs the run
fails (exit 1) with one line per difference. tests/conftest.py wires it in;
`--host-root DIR` reads a fixture tree instead of `/` (its own tests).
The IRQs are read under the host-wide test IRQ lock (tests/support/real_irqs.py),
so another run's test that has IRQs moved at that moment is waited for.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.bind.cgroup import PREFIX as CGROUP_PREFIX
from supervisor.daemon.instance_lock import DEFAULT_RUNTIME_DIR
from tests.support.real_irqs import irq_lock

CGROUP_NAMES = (CGROUP_PREFIX, "ps-")  # the daemon's instance dirs; tests' own v1 cpusets
BEFORE = pytest.StashKey[dict[str, str]]()
FOUND = pytest.StashKey[list[str]]()


class HostResidue:
    """What a test run may leave behind, read under `root` ("/" on the host)."""

    def __init__(self, root: str = "/") -> None:
        self.root = Path(root)

    def _at(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def irqs(self) -> dict[str, str]:
        out: dict[str, str] = {}
        base = self._at("/proc/irq")
        with contextlib.suppress(OSError):
            for name in os.listdir(base):
                if name.isdigit():
                    with contextlib.suppress(OSError):
                        text = (base / name / "smp_affinity_list").read_text().strip()
                        out[f"/proc/irq/{name}/smp_affinity_list"] = text
        return out

    def lock_files(self) -> dict[str, str]:
        base = self._at(DEFAULT_RUNTIME_DIR)
        try:
            names = os.listdir(base)
        except OSError:
            return {}
        return {f"{DEFAULT_RUNTIME_DIR}/{name}": "present" for name in names}

    def cgroup_parents(self) -> Iterator[str]:
        """Each hierarchy's root and this process's own dir in it (cgroup v1 and v2)."""
        yield from ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
        try:
            lines = self._at("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                yield from (f"/sys/fs/cgroup{path}", f"/sys/fs/cgroup/unified{path}")
            for controller in controllers.split(","):
                if controller in ("cpuset", "memory"):
                    yield f"/sys/fs/cgroup/{controller}"
                    yield f"/sys/fs/cgroup/{controller}{path}"

    def cgroups(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for parent in dict.fromkeys(p.rstrip("/") for p in self.cgroup_parents()):
            try:
                names = os.listdir(self._at(parent))
            except OSError:
                continue
            for name in names:
                if name.startswith(CGROUP_NAMES) and self._at(f"{parent}/{name}").is_dir():
                    out[f"{parent}/{name}"] = "present"
        return out

    def read(self) -> dict[str, str]:
        with irq_lock():
            irqs = self.irqs()
        return {**irqs, **self.lock_files(), **self.cgroups()}


def differences(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """One line per path whose state differs (pure)."""
    lines = []
    for path in sorted(before.keys() | after.keys()):
        was, now = before.get(path), after.get(path)
        if was == now:
            continue
        if was is None:
            lines.append(f"{path}: left behind (absent before the run)")
        elif now is None:
            if path.startswith("/proc/irq/"):
                continue  # an IRQ freed by its driver meanwhile: nothing left behind
            lines.append(f"{path}: removed (present before the run)")
        else:
            lines.append(f"{path}: {was} before the run, {now} after")
    return lines


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--host-root",
        default="/",
        help="the root the session-end host check reads (default /; a fixture tree in its tests)",
    )


def _residue(config: pytest.Config) -> HostResidue:
    return HostResidue(str(config.getoption("--host-root")))


def _is_xdist_worker(config: pytest.Config) -> bool:
    """Under pytest-xdist the controller checks the host before its workers start and
    after they all end; a worker's own session ends while others still run tests."""
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if _is_xdist_worker(session.config):
        return
    session.config.stash[BEFORE] = _residue(session.config).read()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(BEFORE, None)
    if before is None:
        return
    found = differences(before, _residue(session.config).read())
    session.config.stash[FOUND] = found
    if found and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    found = terminalreporter.config.stash.get(FOUND, [])
    if found:
        terminalreporter.section("host not as the run found it", sep="=", red=True, bold=True)
        for line in found:
            terminalreporter.line(f"host check: {line}", red=True)
        terminalreporter.line(
            f"host check: {len(found)} difference(s) left by this run (or by another "
            "run on this host meanwhile): the run fails",
            red=True,
        )
