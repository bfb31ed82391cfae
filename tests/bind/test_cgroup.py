"""Per-process cgroups: detection on fixture trees, and real v1 cgroups on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.bind.cgroup import (
    CgroupManager,
    CgroupSetup,
    ProcessCgroup,
    parse_numa_stat,
    parse_proc_cgroup,
    read_cgroup_setup,
)
from supervisor.cpulist import parse_cpulist
from supervisor.errors import KernelError
from supervisor.hostfs import HostFS
from supervisor.state import CgroupObservation
from tests.support.children import close_process, start_shimmed
from tests.support.poll import wait_until

MIB = 1 << 20


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_service_setup(tmp_path: Path, controllers: str) -> CgroupSetup:
    """The setup read from a v2-only tree in which this process sits in a delegated
    service cgroup (the host's root is never used: tests/bind/test_cgroup_v2.py)."""
    write(tmp_path, "proc/self/cgroup", "0::/svc\n")
    write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpuset memory pids\n")
    write(tmp_path, "sys/fs/cgroup/svc/cgroup.controllers", f"{controllers}\n")
    write(tmp_path, "sys/fs/cgroup/svc/cgroup.subtree_control", "")
    setup, _ = read_cgroup_setup(HostFS(str(tmp_path)))
    assert setup is not None
    return setup


# -- pure parsers ----------------------------------------------------------------


def test_parse_proc_cgroup_v1_and_v2_lines() -> None:
    entries = parse_proc_cgroup(
        "4:memory:/process_api/abc\n3:cpuset:/\n2:cpu,cpuacct:/x\n0::/\ngarbage\n"
    )
    assert [(e.hierarchy, e.controllers, e.path) for e in entries] == [
        (4, ("memory",), "/process_api/abc"),
        (3, ("cpuset",), "/"),
        (2, ("cpu", "cpuacct"), "/x"),
        (0, (), "/"),
    ]


def test_parse_numa_stat_v1_counts_pages() -> None:
    text = (
        "total=30 N0=10 N1=20\nfile=10 N0=4 N1=6\nanon=20 N0=6 N1=14\n"
        "unevictable=0 N0=0 N1=0\nhierarchical_total=99 N0=50 N1=49\n"
        "hierarchical_anon=99 N0=50 N1=49\n"
    )
    # anon only: file pages are shared page cache (v1's anon LRU holds shmem)
    assert parse_numa_stat(text, 4096) == {0: 6 * 4096, 1: 14 * 4096}


def test_parse_numa_stat_v2_counts_bytes() -> None:
    text = (
        "anon N0=4096 N1=8192\nfile N0=100 N1=0\nkernel_stack N0=16384 N1=0\n"
        "shmem N0=100 N1=0\nfile_mapped N0=100 N1=0\n"
    )
    # anon + shmem, not file or kernel stacks
    assert parse_numa_stat(text, 1) == {0: 4196, 1: 8192}


# -- detection on fixture trees -------------------------------------------------------


def test_detect_v2_delegated(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/system.slice/llm.service\n")
    write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
    own = "sys/fs/cgroup/system.slice/llm.service"
    write(tmp_path, f"{own}/cgroup.controllers", "cpuset memory pids\n")
    write(tmp_path, f"{own}/cgroup.subtree_control", "")
    setup, why = read_cgroup_setup(HostFS(str(tmp_path)))
    assert setup is not None, why
    assert setup.version == 2
    assert setup.cpuset_parent == own
    assert setup.memory_parent == own
    assert setup.evict_self  # not the root: the supervisor moves into a leaf
    assert setup.controllers == ("cpuset", "memory")


def test_detect_v2_without_memory_uses_cpuset_only(tmp_path: Path) -> None:
    setup = v2_service_setup(tmp_path, "cpuset pids")
    assert setup.evict_self and not setup.evict_all
    assert setup.memory_parent is None
    assert setup.controllers == ("cpuset",)


def test_detect_v2_without_cpuset_says_why(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/user.slice\n")
    write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpuset memory\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/cgroup.controllers", "memory pids\n")
    setup, why = read_cgroup_setup(HostFS(str(tmp_path)))
    assert setup is None
    assert "cpuset is not delegated to /user.slice" in why
    assert "memory pids" in why


def test_detect_v1_comounted_and_missing(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "5:memory:/m\n3:cpuset,cpu:/c\n0::/\n")
    write(tmp_path, "sys/fs/cgroup/cpuset,cpu/c/cpuset.cpus", "0-3\n")
    (tmp_path / "sys/fs/cgroup/memory/m").mkdir(parents=True)
    setup, why = read_cgroup_setup(HostFS(str(tmp_path)))
    assert setup is not None, why
    assert setup.version == 1
    assert setup.cpuset_parent == "sys/fs/cgroup/cpuset,cpu/c"
    assert setup.memory_parent == "sys/fs/cgroup/memory/m"
    empty = tmp_path / "empty"
    write(empty, "proc/self/cgroup", "4:memory:/m\n0::/\n")
    setup, why = read_cgroup_setup(HostFS(str(empty)))
    assert setup is None
    assert "no cpuset controller" in why
    assert read_cgroup_setup(HostFS(str(tmp_path / "nothing")))[0] is None


# -- real cgroups on this machine ------------------------------------------------------------

CHILD = r"""
import mmap, sys
size = int(sys.argv[1])
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
buf = mmap.mmap(-1, size)
for off in range(0, size, mmap.PAGESIZE):
    buf[off] = 1
print(status["Cpus_allowed_list"].strip(), flush=True)
print(open("/proc/self/cgroup").read().replace("\n", ";"), flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def manager(need_root: None) -> Iterator[CgroupManager]:
    fs = HostFS("/")
    setup, why = read_cgroup_setup(fs)
    if setup is None:
        pytest.skip(f"no writable cgroup subtree here: {why}")
    if setup.version == 2 and setup.evict_self:
        pytest.skip("would move the test runner into a leaf cgroup")
    mgr = CgroupManager(fs, setup, suffix=f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    yield mgr
    mgr.close()
    for rel in mgr.instance_dirs:
        assert not fs.exists(rel), f"left behind: {fs.path(rel)}"


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        close_process(proc)


def spawn_in(
    pc: ProcessCgroup, cpus: list[int], size: int
) -> tuple[subprocess.Popen[str], str, str]:
    proc, report = start_shimmed(
        cpus,
        [0],
        [sys.executable, "-c", CHILD, str(size)],
        shim={"cgroups": pc.dirs},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert report.cgroups == pc.dirs, report
    assert report.cgroup_errors == ()
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip(), proc.stdout.readline().strip()


def test_rank_cgroup_lifecycle(
    manager: CgroupManager, children: list[subprocess.Popen[str]]
) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    one = cpus[-1]
    pc = manager.create("rank0", [one], [0])
    try:
        # v1 has no per-rank cpuset (it would block the owner's shrink): the
        # rank shares the supervisor's, and its affinity (the shim's) is its CPUs.
        own_cpus = set(cpus) if pc.version == 1 else {one}
        assert manager.read_effective(pc) == (own_cpus, {0})
        proc, cpus_shown, cgroup_lines = spawn_in(pc, [one], 32 * MIB)
        children.append(proc)
        assert parse_cpulist(cpus_shown) == {one}
        # /proc/<pid>/cgroup shows the rank's path in each hierarchy.
        lines = cgroup_lines.split(";")
        if pc.version == 1:
            assert pc.cpuset_dir is None
            assert not any(manager.instance in line for line in lines if ":cpuset:" in line)
            assert pc.memory_dir is not None
            memory_path = pc.memory_dir.removeprefix("sys/fs/cgroup/memory")
            assert any(line.endswith(f":memory:{memory_path}") for line in lines), lines
        else:
            assert pc.cpuset_dir is not None
            assert f"0::{pc.cpuset_dir.removeprefix('sys/fs/cgroup')}" in lines
        assert manager.read_procs(pc) == [proc.pid]
        if pc.memory_dir is not None:
            by_node = manager.read_numa_stat(pc)
            assert by_node.get(0, 0) >= 32 * MIB, by_node
        if pc.version == 2:
            # update: the running member follows the new cpuset.
            other = cpus[0]
            manager.update(pc, [other], [0])
            wait_until(lambda: os.sched_getaffinity(proc.pid) == {other}, 5, 0.01)
            assert os.sched_getaffinity(proc.pid) == {other}
            assert manager.read_effective(pc) == ({other}, {0})
        proc.kill()
        proc.wait()
    finally:
        for p in children:
            close_process(p)
        manager.remove(pc)
    for rel in (pc.cpuset_dir, pc.memory_dir):
        if rel is not None:
            assert not manager.fs.exists(rel)


def test_a_check_reads_cgroup_procs_every_few_checks_while_proc_cgroup_is_unchanged(
    manager: CgroupManager, children: list[subprocess.Popen[str]]
) -> None:
    """`membership_every` > 1 (the daemon's, with the proc connector on): between
    cgroup.procs reads an unchanged /proc/<pid>/cgroup says the process is inside,
    so a process someone else moved in shows in the reading the keeper takes only
    at the next read; a move out of the cgroup is seen at the very next check."""
    if manager.setup.version != 1:
        pytest.skip("moves processes between v1 memory cgroups")
    assert manager.setup.memory_parent is not None
    cpus = sorted(os.sched_getaffinity(0))
    pc = manager.create("rank3", cpus, [0])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc, _, _ = spawn_in(pc, cpus, MIB)
        children.append(proc)
        rel = pc.procs_dir
        parent = Path(manager.fs.path(manager.setup.memory_parent)) / "cgroup.procs"
        inside = CgroupObservation((), None, None, False)

        def move_in() -> None:
            (Path(manager.fs.path(rel)) / "cgroup.procs").write_text(str(other.pid))

        # The default: every check reads cgroup.procs.
        assert manager.observe(pc, proc.pid) == inside
        move_in()
        assert manager.observe(pc, proc.pid) == inside
        assert manager.recent_procs(rel, 60) == sorted([proc.pid, other.pid])
        parent.write_text(str(other.pid))

        def observe() -> CgroupObservation:  # as the check loop does with the connector on
            return manager.observe(pc, proc.pid, membership_every=3)

        assert observe() == inside  # read: [proc]
        assert manager.recent_procs(rel, 60) == [proc.pid]
        move_in()
        for _ in range(2):  # confirmed by /proc/<pid>/cgroup: the file is not read
            assert observe() == inside
            assert manager.recent_procs(rel, 60) == [proc.pid]
        assert observe() == inside  # the third: read again
        assert manager.recent_procs(rel, 60) == sorted([proc.pid, other.pid])

        parent.write_text(str(proc.pid))  # someone moves the process out
        assert observe() == CgroupObservation((), None, None, True)
        (Path(manager.fs.path(rel)) / "cgroup.procs").write_text(str(proc.pid))
        assert observe() == inside
        parent.write_text(str(other.pid))
        parent.write_text(str(proc.pid))
        Path(manager.fs.path(rel)).rmdir()  # and removes the dir
        missing = observe()
        assert missing.missing == (manager.fs.path(rel),), missing
    finally:
        other.kill()
        other.wait()
        for p in children:
            close_process(p)
        manager.remove(pc)


def test_create_outside_the_parent_cpuset_leaves_nothing(manager: CgroupManager) -> None:
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    if manager.setup.version == 1:
        # v1 ranks get memory cgroups only (a per-rank cpuset would block a shrink of
        # the supervisor's own by its owner): no cpuset is written, so none can fail.
        pc = manager.create("bad", [max(online) + 1], [0])
        try:
            assert pc.cpuset_dir is None and pc.memory_dir is not None
            assert manager.fs.exists(pc.memory_dir)
        finally:
            manager.remove(pc)
        assert not manager.fs.exists(f"{manager.setup.memory_parent}/{manager.instance}/bad")
        return
    # Beyond nr_cpu_ids: ERANGE; a CPU outside the parent's cpuset: EINVAL.
    with pytest.raises(KernelError) as info:
        manager.create("bad", [max(online) + 1], [0])
    assert "cpuset.cpus" in info.value.target
    assert not manager.fs.exists(f"{manager.setup.cpuset_parent}/{manager.instance}/bad")
    if manager.setup.memory_parent is not None:
        assert not manager.fs.exists(f"{manager.setup.memory_parent}/{manager.instance}/bad")


def test_update_rejects_empty_sets(manager: CgroupManager) -> None:
    pc = manager.create("rank1", sorted(os.sched_getaffinity(0)), [0])
    try:
        with pytest.raises(KernelError, match="at least one CPU"):
            manager.update(pc, [], [0])
    finally:
        manager.remove(pc)


def test_bad_names_are_refused(tmp_path: Path) -> None:
    setup = v2_service_setup(tmp_path, "cpuset")
    with pytest.raises(ValueError, match="suffix"):
        CgroupManager(HostFS(str(tmp_path)), setup, suffix="a/b")
    mgr = CgroupManager(HostFS(str(tmp_path)), setup)
    for name in ("", "a/b", "..", "supervisor"):
        with pytest.raises(ValueError, match="bad cgroup name"):
            mgr.create(name, [0], [0])
