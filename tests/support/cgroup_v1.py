"""cgroup v1 directories a test or bench makes, changes as an orchestrator would, and removes.

Does I/O: writes under /sys/fs/cgroup/{cpuset,memory} (needs root). Every
cgroup made here is removed afterwards with everything in it: its tasks are
moved to the hierarchy root and its directories rmdir'ed deepest first.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from supervisor.cpulist import format_cpulist, parse_cpulist

V1_CPUSET = Path("/sys/fs/cgroup/cpuset")
V1_MEMORY = Path("/sys/fs/cgroup/memory")


def v1_available() -> str | None:
    """None when a v1 cpuset with CPUs 0 and 1 can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if not (V1_CPUSET / "cpuset.cpus").exists():
        return "no cgroup v1 cpuset hierarchy at /sys/fs/cgroup/cpuset"
    if not {0, 1} <= os.sched_getaffinity(0):
        return "needs CPUs 0 and 1"
    return None


def _descendants_deepest_first(root: Path) -> list[Path]:
    dirs = [Path(d) for d, _, _ in os.walk(root)]
    return sorted((d for d in dirs if d != root), key=lambda d: -len(d.parts))


def write_v1_cpus(cgroup: Path, cpus: set[int]) -> None:
    """Set a v1 cpuset's CPUs the way an orchestrator must when it has children.

    Shrinking: v1 refuses a parent whose new CPUs leave out a child's (EBUSY),
    so every descendant shrinks first, deepest first, to its CPUs ∩ the new
    set (or the whole new set when that is empty). Growing needs nothing first.
    """
    for child in _descendants_deepest_first(cgroup):
        own = parse_cpulist((child / "cpuset.cpus").read_text())
        if not own or own <= cpus:
            continue
        (child / "cpuset.cpus").write_text(format_cpulist((own & cpus) or cpus))
    (cgroup / "cpuset.cpus").write_text(format_cpulist(cpus))


def remove_v1_tree(root: Path, hierarchy: Path) -> None:
    """Move every task of `root`'s tree to the hierarchy root, then rmdir deepest first."""
    if not root.exists():
        return
    for d in [*_descendants_deepest_first(root), root]:
        for name in ("cgroup.procs", "tasks"):
            with contextlib.suppress(OSError):
                for pid in (d / name).read_text().split():
                    with contextlib.suppress(OSError):
                        (hierarchy / "cgroup.procs").write_text(pid)
        deadline = time.monotonic() + 5
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # an exited task stays a member until reaped


@contextlib.contextmanager
def v1_cgroup(
    hierarchy: Path, name: str, settings: Sequence[tuple[str, str]] = ()
) -> Iterator[Path]:
    """A fresh cgroup under `hierarchy`'s root with `settings` written in order;
    removed with everything in it."""
    cg = hierarchy / name
    remove_v1_tree(cg, hierarchy)
    cg.mkdir()
    try:
        for file, value in settings:
            (cg / file).write_text(value)
        yield cg
    finally:
        remove_v1_tree(cg, hierarchy)


def v1_cpuset(
    name: str, cpus: str = "0-1", mems: str = "0"
) -> contextlib.AbstractContextManager[Path]:
    """A fresh v1 cpuset under the hierarchy root; removed with everything in it."""
    return v1_cgroup(V1_CPUSET, name, [("cpuset.mems", mems), ("cpuset.cpus", cpus)])


def own_memory_cgroup() -> Path | None:
    """This process's v1 memory cgroup directory, if it has one."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return V1_MEMORY / path.lstrip("/")
    return None
