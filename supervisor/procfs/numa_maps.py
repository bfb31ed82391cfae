"""Resident memory per NUMA node from /proc/<pid>/numa_maps (`parse_*` pure; `read_*`
through HostFS)."""

from __future__ import annotations

from supervisor.errors import translate_oserror
from supervisor.hostfs import HostFS

PAGE_BYTES = 4096  # numa_maps lines without kernelpagesize_kB (old kernels) count base pages


def parse_numa_maps(text: str, default_page_bytes: int = PAGE_BYTES) -> dict[int, int]:
    """Resident bytes per NUMA node of a process's own memory, from numa_maps (pure).

    Each mapping line counts its pages per node as N<node>=<pages>, in units
    of its own `kernelpagesize_kB=` (huge pages count 2048 or 1048576 kB each;
    Documentation/admin-guide/mm/numa_memory_policy.rst, proc(5)).

    Mapped files (shared libraries, model files) are left out: their pages
    are page cache shared with other processes; counting them made two ranks
    on different nodes each see the other's libraries as remote, and page
    migration then moved the same pages back and forth. What counts is the
    memory the process allocated: private anonymous memory, shared anonymous
    and shmem mappings (/dev/zero, memfd, SysV, /dev/shm) and hugetlbfs, the
    same memory a cgroup's memory.numa_stat `anon` (v1) or `anon` + `shmem`
    (v2) lines count.
    What remains is the process's own memory (heap, stacks, anonymous and
    pinned buffers), the same thing the cgroup's `anon` line counts.
    """
    by_node: dict[int, int] = {}
    for line in text.splitlines():
        counts: list[tuple[int, int]] = []
        page_bytes = default_page_bytes
        for token in line.split():
            if token[0] == "N" and "=" in token:
                node_text, _, pages_text = token[1:].partition("=")
                if node_text.isdigit() and pages_text.isdigit():
                    counts.append((int(node_text), int(pages_text)))
            elif token.startswith("kernelpagesize_kB="):
                size_text = token[18:]
                if size_text.isdigit():
                    page_bytes = int(size_text) * 1024
            elif token.startswith("file=") and not _own_shared_memory(token, line):
                counts = []
                break
        for node, pages in counts:
            by_node[node] = by_node.get(node, 0) + pages * page_bytes
    return by_node


_SHMEM_FILES = ("file=/dev/zero", "file=/SYSV", "file=/memfd:", "file=/dev/shm/")


def _own_shared_memory(file_token: str, line: str) -> bool:
    """A `file=` mapping that is allocated memory, not a mapped file: shmem
    (MAP_SHARED|MAP_ANONYMOUS shows as /dev/zero) or hugetlbfs (`huge`)."""
    return file_token.startswith(_SHMEM_FILES) or " huge" in line


def read_numa_maps(fs: HostFS, pid: int) -> dict[int, int]:
    """Resident bytes per node of `pid` (walks its page tables: cost grows with RSS).

    Raises `errors.Gone` when the process no longer exists.
    """
    try:
        text = fs.read_text(f"proc/{pid}/numa_maps")
    except OSError as err:
        raise translate_oserror(f"pid {pid}", err) from None
    return parse_numa_maps(text)


def parse_own_ranges(
    maps_text: str, numa_text: str, nodes: frozenset[int]
) -> list[tuple[int, int, int, int]]:
    """(start, end, page bytes, pages on `nodes`) of the mappings whose memory the
    process allocated (the ones `parse_numa_maps` counts) that hold pages on
    `nodes` (pure).

    `maps_text` is /proc/<pid>/maps (it has each mapping's end), `numa_text`
    its numa_maps (where each mapping's pages are), joined by start address.
    Mapped files are left out: their pages are page cache other processes
    map too, and moving them for one rank takes them from another (the tug of
    war decide.py backs off from). Pages of what is left that another
    process also maps (after a fork, shared memory) are left by the move
    itself (move_pages(2) without MPOL_MF_MOVE_ALL).
    """
    ends: dict[int, int] = {}
    for line in maps_text.splitlines():
        low, _, rest = line.partition("-")
        high = rest.split(" ", 1)[0]
        if low and high:
            ends[int(low, 16)] = int(high, 16)
    ranges: list[tuple[int, int, int, int]] = []
    for line in numa_text.splitlines():
        tokens = line.split()
        if not tokens:
            continue
        page_bytes = PAGE_BYTES
        remote = 0
        for token in tokens[1:]:
            if token.startswith("file=") and not _own_shared_memory(token, line):
                remote = 0
                break
            if token.startswith("kernelpagesize_kB="):
                size_text = token[18:]
                if size_text.isdigit():
                    page_bytes = int(size_text) * 1024
            elif token[0] == "N" and "=" in token:
                node_text, _, pages = token[1:].partition("=")
                if node_text.isdigit() and int(node_text) in nodes and pages.isdigit():
                    remote += int(pages)
        start = int(tokens[0], 16)
        end = ends.get(start)
        if remote and end is not None:
            ranges.append((start, end, page_bytes, remote))
    return ranges


# numa_maps' policy words (mm/mempolicy.c mpol_to_str) -> the step /placement shows.
_POLICY_STEPS = {"bind": "bind", "local": "local", "default": "local", "prefer": "preferred"}


def parse_task_policy(line: str) -> tuple[str, tuple[int, ...]] | None:
    """(step, nodes) of a numa_maps line's policy: "bind:1" -> ("bind", (1,));
    "default" and "local" -> ("local", ()): pages follow the CPUs (pure).

    The first mapping of a process has no policy of its own, so its line
    shows the task's policy (fs/proc/task_mmu.c show_numa_map), the one
    set_mempolicy(2) set: what only the process itself could have set.
    None for a line without one, or a policy we do not place by (interleave).
    """
    words = line.split()
    if len(words) < 2:
        return None
    mode, _, nodes = words[1].partition(":")
    step = _POLICY_STEPS.get(mode.split("=", 1)[0])
    if step is None:
        return None
    ids: list[int] = []
    for part in nodes.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            ids.extend(range(int(low), int(high or low) + 1))
    return step, tuple(ids)


def read_task_policy(fs: HostFS, pid: int) -> tuple[str, tuple[int, ...]] | None:
    """The memory policy of `pid` (its first numa_maps line only), or None."""
    head = fs.read_head(f"proc/{pid}/numa_maps", 4096, "numa_maps")
    if not head:
        return None
    return parse_task_policy(head.decode("ascii", "replace").split("\n", 1)[0])
