"""A cgroup's member list is read whole: cgroupfs files are seq_files, whose first
read(2) returns one page (about 700 pids), so each read goes on to EOF.

A real cgroup (on the cgroup2 hierarchy, or v1 `pids`) with 5,000 real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.hostfs import HostFS
from supervisor.trees.tree import read_cgroup_procs

N_CHILDREN = 5000

# Joins the cgroup, forks the children (each waits for EOF on a pipe the test
# holds, so none outlives the test), prints their pids, then waits too.
SPAWNER = r"""
import os, sys
procs, n = sys.argv[1], int(sys.argv[2])
with open(procs, "w") as f:
    f.write(str(os.getpid()))
r = int(sys.argv[3])
pids = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        os.read(r, 1)
        os._exit(0)
    pids.append(pid)
print(" ".join(map(str, pids)), flush=True)
os.read(r, 1)
for pid in pids:
    os.waitpid(pid, 0)
"""


def _hierarchy() -> Path | None:
    for top in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/memory"):
        if os.access(top, os.W_OK) and os.path.exists(f"{top}/cgroup.procs"):
            return Path(top)
    return None


@pytest.fixture
def crowded_cgroup() -> Iterator[tuple[str, set[int]]]:
    top = _hierarchy()
    if top is None:
        pytest.skip("no writable cgroup hierarchy")
    path = top / f"ps-test-procs-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    r, w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-S", "-c", SPAWNER, str(path / "cgroup.procs"), str(N_CHILDREN), str(r)],
        stdout=subprocess.PIPE,
        pass_fds=(r,),
    )
    os.close(r)
    try:
        assert child.stdout is not None
        pids = {int(p) for p in child.stdout.readline().split()}
        assert len(pids) == N_CHILDREN
        rel = str(path.relative_to("/"))
        yield rel, pids | {child.pid}
    finally:
        os.close(w)  # every child reads EOF and exits
        child.wait(timeout=120)
        path.rmdir()


def test_cgroup_procs_of_5000_processes_reads_whole(crowded_cgroup: tuple[str, set[int]]) -> None:
    rel, pids = crowded_cgroup
    fs = HostFS("/")
    text = fs.read_text(f"{rel}/cgroup.procs")
    assert len(text) > 4 * 4096  # many pages: the first read alone would not do
    assert {int(w) for w in text.split()} == pids
    assert set(read_cgroup_procs(fs, rel)) == pids
