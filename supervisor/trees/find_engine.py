"""Finding a running engine the supervisor did not start (does I/O: reads /proc).

`[engine] attach` (docs/attach.md) names it by its systemd unit, its cgroup path
or a command-line substring. `find_engine` scans /proc once: the processes the
target names (a unit or cgroup: every process whose /proc/<pid>/cgroup shows that
path, in any hierarchy, v1 or v2; a match: every process whose command line holds
the text), then their root: the one whose parent is not among them, the oldest
first. A shell that started the engine by its command line matches too and is the
root (its children are the engine's tree either way). The pure parts
(`cgroup_paths`, `names`, `pick_root`) are tested on their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from supervisor.config_sections import AttachTarget
from supervisor.errors import KernelError
from supervisor.hostfs import HostFS
from supervisor.procfs.files import read_cmdline
from supervisor.procfs.identity import ProcessId
from supervisor.procfs.stat import ProcStat, scan_procs
from supervisor.topology.cgroupns import (
    Hierarchy,
    NamespaceRoot,
    current_roots,
    resolve_lines,
)
from supervisor.topology.model import CgroupLine


@dataclass(frozen=True, slots=True)
class FoundEngine:
    """The engine's root process, and the cgroup path that named it (a match: None)."""

    pid: int
    start_time: int
    ppid: int
    cgroup: str | None

    @property
    def id(self) -> ProcessId:
        return ProcessId(self.pid, self.start_time)


def cgroup_paths(text: str) -> list[tuple[str, str]]:
    """(controllers, path) of each line of /proc/<pid>/cgroup ("" for v2's controllers)."""
    out: list[tuple[str, str]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[1], parts[2].strip()))
    return out


def host_paths(
    paths: list[tuple[str, str]], roots: Mapping[Hierarchy, NamespaceRoot]
) -> list[tuple[str, str]]:
    """`paths` as host paths: a supervisor in a private cgroup namespace (a node
    agent's child in its DaemonSet pod) sees other processes' cgroups as
    "/../../<host path below its own root>"; the target names the host path."""
    lines = [CgroupLine(0, tuple(c.split(",")) if c else (), p) for c, p in paths]
    return [(",".join(line.controllers), line.path) for line in resolve_lines(lines, roots)]


def names(target: AttachTarget, paths: Sequence[tuple[str, str]], cmdline: str) -> str | None:
    """The cgroup path (or, for a match, the command line) by which `target` names a
    process with these cgroup `paths` and `cmdline`; None when it does not."""
    if target.how == "match":
        return cmdline if cmdline and target.value in cmdline else None
    want = target.value.rstrip("/")
    for _, path in paths:
        if target.how == "unit":
            # The unit's cgroup or one below it (a service's payload sub-cgroup).
            if target.value in path.split("/"):
                parts = path.split("/")
                return "/".join(parts[: parts.index(target.value) + 1])
        elif path == want or path.startswith(want + "/"):
            return want
    return None


def pick_root(named: Mapping[int, str], stats: Mapping[int, ProcStat]) -> int | None:
    """The root of the named processes: its parent is not named; the oldest
    (then the lowest pid) of several."""
    roots = [pid for pid in named if pid in stats and stats[pid].ppid not in named]
    if not roots:
        return None
    return min(roots, key=lambda pid: (stats[pid].start_time, pid))


SIGKILL_BIT = 1 << (9 - 1)  # in /proc/<pid>/status's SigPnd and ShdPnd masks


def dying(status: str) -> bool:
    """True when a /proc/<pid>/status shows a SIGKILL pending (pure): killed,
    not yet a zombie (an engine's worker orphaned by its killed parent)."""
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("SigPnd", "ShdPnd"):
            with contextlib.suppress(ValueError):
                if int(value.strip(), 16) & SIGKILL_BIT:
                    return True
    return False


def find_engine(fs: HostFS, target: AttachTarget, me: int) -> FoundEngine | None:
    """The engine `target` names now, or None while there is none. Never the
    supervisor (`me`) itself, nor a zombie, a killed process or a kernel thread. Blocking."""
    stats = scan_procs(fs)
    named: dict[int, str] = {}
    roots: dict[Hierarchy, NamespaceRoot] | None = None  # read once a scan, when needed
    for pid, stat in stats.items():
        if pid == me or stat.state in ("Z", "X"):
            continue
        try:
            cmdline = read_cmdline(fs, pid)
        except KernelError:
            continue  # unreadable: not one to attach to
        if not cmdline:
            continue  # gone, or a kernel thread
        paths: list[tuple[str, str]] = []
        if target.how != "match":
            text = fs.read_optional(f"proc/{pid}/cgroup")
            if text is None:
                continue
            paths = cgroup_paths(text)
            if any(path.startswith("/..") for _, path in paths):
                roots = current_roots(fs) if roots is None else roots
                paths = host_paths(paths, roots)
        found = names(target, paths, cmdline)
        if found is not None and not dying(fs.read_optional(f"proc/{pid}/status") or ""):
            named[pid] = found
    root = pick_root(named, stats)
    if root is None:
        return None
    stat = stats[root]
    cgroup = None if target.how == "match" else named[root]
    return FoundEngine(root, stat.start_time, stat.ppid, cgroup)
