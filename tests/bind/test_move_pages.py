"""Moving a process's private pages: which mappings, how many pages a call, the budget.

Parsing is checked on real /proc text of a real child; the move itself on
this one-node box moves pages to the node they are on (the kernel answers
with that node for each), which is enough to see the walk, the chunking and
the budget. Which pages really change nodes, and that shared pages stay, is
shown in the multi-NUMA guest (tests/trees/test_memory_modes_vm.py,
tests/bench/migrate_bench.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.bind.binder import PAGES_PER_CALL, Binder
from supervisor.errors import Gone
from supervisor.hostfs import HostFS
from supervisor.procfs.numa_maps import PAGE_BYTES, parse_own_ranges, parse_task_policy

MIB = 1 << 20

CHILD = """
import mmap, sys
private = mmap.mmap(-1, 96 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
shared = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
for buf in (private, shared):
    for at in range(0, len(buf), 4096):
        buf[at] = 1
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def child() -> object:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    yield proc
    proc.kill()
    proc.wait()


def test_only_the_memory_the_process_allocated_is_walked(child: object) -> None:
    """Its anonymous memory and shared memory (what its local ratio counts);
    never a mapped file (page cache: other processes' too)."""
    pid = child.pid  # type: ignore[attr-defined]
    maps = Path(f"/proc/{pid}/maps").read_text()
    numa = Path(f"/proc/{pid}/numa_maps").read_text()
    ranges = parse_own_ranges(maps, numa, frozenset({0}))
    sizes = [end - start for start, end, _, _ in ranges]
    assert 96 * MIB in sizes  # the private buffer
    assert 8 * MIB in sizes  # MAP_SHARED|MAP_ANONYMOUS (file=/dev/zero), this process's alone
    files = {
        int(line.split("-", 1)[0], 16)
        for line in maps.splitlines()
        if len(line.split()) >= 6 and line.split()[5].startswith("/") and "/dev/zero" not in line
    }
    assert files and not files & {start for start, _, _, _ in ranges}
    assert all(page == PAGE_BYTES and end > start for start, end, page, _ in ranges)
    by_size = {end - start: remote for start, end, _, remote in ranges}
    assert by_size[96 * MIB] == 96 * MIB // PAGE_BYTES  # every page touched, all on node 0
    assert parse_own_ranges(maps, numa, frozenset({1})) == []  # nothing on node 1


def test_a_move_stops_at_its_budget_and_goes_on_next_time(child: object) -> None:
    pid = child.pid  # type: ignore[attr-defined]
    binder = Binder(HostFS("/"))
    moved, left = binder.move_own_pages(pid, (0,), 0, 8 * MIB)
    assert 0 < moved <= 8 * MIB + PAGES_PER_CALL * PAGE_BYTES  # bytes
    assert left > 0  # the rest: the next pass's share
    # A budget past what it holds: every present private page, in calls of
    # PAGES_PER_CALL at most (the 96 MiB buffer alone is 1.5 of them); nothing left.
    assert 96 * MIB > PAGES_PER_CALL * PAGE_BYTES
    moved, left = binder.move_own_pages(pid, (0,), 0, 256 * MIB)
    assert moved >= 96 * MIB and left == 0


def test_a_gone_process_is_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(Gone):
        Binder(HostFS("/")).move_own_pages(proc.pid, (0,), 0, MIB)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("55d0 bind:1 anon=3 dirty=3 N1=3", ("bind", (1,))),
        ("55d0 bind=static:0-1 file=/usr/bin/python3", ("bind", (0, 1))),
        ("55d0 default file=/usr/bin/python3 mapped=2", ("local", ())),
        ("55d0 local anon=1 N0=1", ("local", ())),
        ("55d0 prefer:0 anon=1", ("preferred", (0,))),
        ("55d0 interleave:0-1 anon=1", None),
        ("", None),
    ],
)
def test_the_task_policy_of_a_numa_maps_line(line: str, expected: object) -> None:
    assert parse_task_policy(line) == expected
