"""A process's own /proc files: command line, environment, threads, status (I/O via HostFS).

`parse_*` are pure. A process that is gone reads as None or [] here: the
callers skip it for the pass, they never fail on it.
"""

from __future__ import annotations

from supervisor.cpulist import parse_cpulist
from supervisor.hostfs import HostFS


def read_cmdline(fs: HostFS, pid: int) -> str | None:
    """The command line, words joined by single spaces (what setproctitle rewrites)."""
    raw = fs.read_optional(f"proc/{pid}/cmdline")
    if raw is None:
        return None
    # setproctitle pads the rewritten argv area with NULs: drop empty words.
    return " ".join(word for word in raw.split("\0") if word)


def parse_environ(raw: str) -> dict[str, str]:
    """A /proc/<pid>/environ text (NUL-separated NAME=value) as a dict (pure)."""
    env: dict[str, str] = {}
    for item in raw.split("\0"):
        name, sep, value = item.partition("=")
        if sep and name:
            env[name] = value
    return env


def parse_status_thread(text: str) -> tuple[str, tuple[int, ...]]:
    """Name and Cpus_allowed_list of a /proc/<pid>/task/<tid>/status text (pure).

    The status Name is escaped (proc(5): "\\n" for a newline); the comm file
    is not. Raises ValueError when a field is missing.
    """
    name: str | None = None
    cpus: tuple[int, ...] | None = None
    for line in text.splitlines():
        if line.startswith("Name:"):
            name = line[5:].strip("\t ")
        elif line.startswith("Cpus_allowed_list:"):
            cpus = tuple(sorted(parse_cpulist(line[18:])))
            break  # Name comes first; nothing after this is needed
    if name is None or cpus is None:
        raise ValueError("status has no Name or Cpus_allowed_list")
    return name, cpus


def list_tids(fs: HostFS, pid: int) -> list[int]:
    """The tids of `pid`'s threads (its task directory), in order; [] when it is gone."""
    return sorted(int(t) for t in fs.listdir(f"proc/{pid}/task") if t.isdigit())
