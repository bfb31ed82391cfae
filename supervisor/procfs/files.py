"""A process's own /proc files: command line, environment, threads, status (I/O via HostFS).

`parse_*` are pure. A process that is gone reads as None or [] here: the
callers skip it for the pass, they never fail on it.
"""

from __future__ import annotations

from collections.abc import Collection

from supervisor.cpulist import parse_cpulist
from supervisor.hostfs import HostFS

# A title is what setproctitle writes over argv: short. A command line can be
# as long as ARG_MAX allows (a 1.2 MB one is legal); the head is all any
# reader here needs: titles, `cmdline:` rank rules, the API's `children`.
CMDLINE_HEAD_BYTES = 1 << 16


def parse_argv(raw: bytes) -> list[str]:
    """A /proc/<pid>/cmdline's words (pure).

    setproctitle pads the rewritten argv area with NULs: empty words drop."""
    return [word for word in raw.decode("utf-8", "replace").split("\0") if word]


def read_cmdline(fs: HostFS, pid: int) -> str | None:
    """The head of the command line (CMDLINE_HEAD_BYTES), words joined by single
    spaces (what setproctitle rewrites); None when the process is gone."""
    argv = read_argv(fs, pid)
    return None if argv is None else " ".join(argv)


def read_argv(fs: HostFS, pid: int) -> list[str] | None:
    """The head of the command line (CMDLINE_HEAD_BYTES) as words; None when the
    process is gone."""
    raw = fs.read_head(f"proc/{pid}/cmdline", CMDLINE_HEAD_BYTES, f"pid {pid}")
    return None if raw is None else parse_argv(raw)


def read_environ(fs: HostFS, pid: int, names: Collection[str]) -> dict[str, str] | None:
    """The variables `names` of `pid`'s environment (those set), streamed: a scan
    stops once all are found and never holds more than one chunk and one
    variable, whatever the environment's size. None when the process is gone.

    /proc/<pid>/environ is the environment the process was exec'd with (later
    setenv calls are not in it; proc(5)), which is where launchers put LOCAL_RANK.
    """
    chunks = fs.stream(f"proc/{pid}/environ", f"pid {pid}")
    if chunks is None:
        return None
    wanted = {name.encode() + b"=" for name in names}
    found: dict[str, str] = {}
    if not wanted:
        return found
    tail = b""
    for chunk in chunks:
        items = (tail + chunk).split(b"\0")
        tail = items.pop()  # the last item may go on in the next chunk
        if len(tail) > _ENVIRON_ITEM_MAX_BYTES:
            tail = b"\xff"  # one huge variable: skip to its end, never hold it
        for item in items:
            _take(item, wanted, found)
        if len(found) == len(wanted):
            return found
    _take(tail, wanted, found)
    return found


_ENVIRON_ITEM_MAX_BYTES = 1 << 16  # the variables looked up are small (LOCAL_RANK=3)


def _take(item: bytes, wanted: set[bytes], found: dict[str, str]) -> None:
    name, sep, value = item.partition(b"=")
    if sep and name + b"=" in wanted:
        found.setdefault(name.decode("utf-8", "replace"), value.decode("utf-8", "replace"))


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
