"""supervisor.watch.observe against real processes (named threads, touched memory) and trees."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from supervisor.cpulist import parse_cpulist
from supervisor.errors import Gone, TopologyError
from supervisor.hostfs import HostFS
from supervisor.plan.keys import ThreadRole
from supervisor.plan.placement import Slot
from supervisor.plan.threads import LiveThread, RoleMatcher
from supervisor.procfs.files import parse_status_thread
from supervisor.procfs.numa_maps import parse_numa_maps, read_numa_maps
from supervisor.topology.cgroup import CPUSET_RESOLVE_EVERY, CpusetCache, parse_status_allowed
from supervisor.watch.observe import (
    ThreadScanner,
    local_memory_ratio,
    observe_process,
    read_irq_delivery,
    read_online_cpus,
    read_self_allowed,
    read_threads,
)
from tests.support.children import ThreadedChild
from tests.support.vm import run_checks_in_vm

MIB = 1 << 20
OBSERVE_NUMA = (
    "node1-and-numactl",  # the guest has node 1 and numactl (else nothing below ran)
    "numa-maps-pages-on-node1",  # 64 MiB under numactl --membind=1: >= 64 MiB on N1
    "ratio-local-to-node1",  # local_memory_ratio(by_node, [1]) > 0.5
    "observed-ratio-low",  # observe_process against a node-0 slot: ratio < 0.5
    "memory-locality-finding",  # diff() finds exactly one memory_locality drift
)


@pytest.fixture
def child() -> Iterator[ThreadedChild]:
    with ThreadedChild(
        ["acl_thread", "release_thread", "so-compile-0", "a-long-thread-name-x"]
    ) as c:
        yield c


LIVE = HostFS("/")


def _by_tid(threads: Sequence[LiveThread]) -> dict[int, LiveThread]:
    return {t.tid: t for t in threads}


def test_read_threads_names_tids_affinity(child: ThreadedChild) -> None:
    allowed = tuple(sorted(os.sched_getaffinity(child.pid)))
    acl = child.threads["acl_thread"]
    os.sched_setaffinity(acl, {allowed[-1]})
    for method in ("syscall", "status"):
        threads = _by_tid(read_threads(LIVE, child.pid, method))  # type: ignore[arg-type]
        assert child.pid in threads  # the main thread is a thread too
        for name, tid in child.threads.items():
            assert threads[tid].name == name[:15]
        assert threads[acl].cpus == (allowed[-1],)
        assert threads[child.threads["release_thread"]].cpus == allowed
        assert set(threads) == {int(t) for t in os.listdir(f"/proc/{child.pid}/task")}


def _scan_until_gone(
    scanner: ThreadScanner, tid: int, timeout_s: float = 10.0
) -> dict[int, LiveThread]:
    """Scan until `tid` is gone: Python's join() returns just before the OS thread exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        threads = _by_tid(scanner.scan())
        if tid not in threads:
            return threads
        assert time.monotonic() < deadline, f"tid {tid} still listed after {timeout_s}s"
        os.sched_yield()


def test_thread_scanner_follows_new_and_gone_threads(child: ThreadedChild) -> None:
    scanner = ThreadScanner(LIVE, child.pid, relist_every=1000)
    first = _by_tid(scanner.scan())
    assert first == _by_tid(read_threads(LIVE, child.pid))
    # One thread more and one less: the count may be unchanged, yet both show.
    new_tid = child.command("spawn hccl_worker")
    gone_tid = child.command("stop release_thread")
    second = _scan_until_gone(scanner, gone_tid)
    assert second[new_tid].name == "hccl_worker"
    # A thread that exits after a scan listed it is skipped, not an error.
    gone2 = child.command("stop acl_thread")
    third = _scan_until_gone(scanner, gone2)
    assert set(third) == set(second) - {gone2}
    assert _by_tid(scanner.scan()) == _by_tid(read_threads(LIVE, child.pid))


def test_thread_scanner_sees_affinity_changes_every_scan(child: ThreadedChild) -> None:
    allowed = sorted(os.sched_getaffinity(child.pid))
    scanner = ThreadScanner(LIVE, child.pid, relist_every=1000)
    tid = child.threads["so-compile-0"]
    for _ in range(5):
        scanner.scan()
    os.sched_setaffinity(tid, {allowed[0]})
    assert _by_tid(scanner.scan())[tid].cpus == (allowed[0],)


def test_a_settled_scan_hands_back_its_tuple_until_something_changes(
    child: ThreadedChild,
) -> None:
    """Once every thread is past its young scans, `observe` returns the very tuple
    it returned last (what lets decide skip its walk over the threads); an
    affinity change, a new or an exited thread, and a rename (at the renaming
    scan) each give a new one with the change in it."""
    matcher = RoleMatcher("workers", (ThreadRole("comm", "workers", "hccl*"),))
    scanner = ThreadScanner(LIVE, child.pid, relist_every=1000, rename_every=1000, young_scans=2)
    for _ in range(3):
        settled = scanner.observe(matcher)
    assert scanner.observe(matcher) is settled
    tid = child.threads["so-compile-0"]
    cpu = min(os.sched_getaffinity(child.pid))
    os.sched_setaffinity(tid, {cpu})
    moved = scanner.observe(matcher)
    assert moved is not settled and {t.tid: t.cpus for t in moved}[tid] == (cpu,)
    assert scanner.observe(matcher) is moved
    new_tid = child.command("spawn hccl_worker")
    grown = scanner.observe(matcher)
    assert {t.tid: t.role for t in grown}[new_tid] == "comm"
    gone_tid = child.command("stop release_thread")
    shrunk = scanner.observe(matcher)
    assert gone_tid not in {t.tid for t in shrunk} and new_tid in {t.tid for t in shrunk}
    assert scanner.observe(matcher) is scanner.observe(matcher)
    # The periodic listing finds the same tids: still the same tuple.
    listing = ThreadScanner(LIVE, child.pid, relist_every=2, rename_every=1000, young_scans=2)
    for _ in range(3):
        listed = listing.observe(matcher)
    assert all(listing.observe(matcher) is listed for _ in range(4))
    renaming = ThreadScanner(LIVE, child.pid, relist_every=1000, rename_every=6, young_scans=2)
    for _ in range(3):
        renaming.observe(matcher)
    acl = child.command("rename acl_thread renamed-acl")
    names = [{t.tid: t.name for t in renaming.observe(matcher)}[acl] for _ in range(6)]
    assert names[0] == "acl_thread" and names[-1] == "renamed-acl"  # at the renaming scan


def test_thread_scanner_process_gone(child: ThreadedChild) -> None:
    scanner = ThreadScanner(LIVE, child.pid)
    assert scanner.scan()
    child.close()
    assert scanner.scan() == []
    assert read_threads(LIVE, child.pid) == []


def test_read_threads_skips_vanished_threads_in_a_tree(tmp_path: Path) -> None:
    task = tmp_path / "proc/42/task"
    (task / "42").mkdir(parents=True)
    (task / "42/status").write_text("Name:\tworker\nState:\tS\nCpus_allowed_list:\t0-3\n")
    (task / "43").mkdir()  # listed, but its files are gone: exited mid-scan
    fs = HostFS(str(tmp_path))
    assert read_threads(fs, 42) == [LiveThread(42, "worker", (0, 1, 2, 3))]
    assert ThreadScanner(fs, 42).scan() == [LiveThread(42, "worker", (0, 1, 2, 3))]
    with pytest.raises(ValueError, match="live host"):
        read_threads(fs, 42, "syscall")


def test_parse_status_thread() -> None:
    assert parse_status_thread("Name:\tNCCL Proxy\nUmask:\t0022\nCpus_allowed_list:\t0,2-3\n") == (
        "NCCL Proxy",
        (0, 2, 3),
    )
    with pytest.raises(ValueError, match="Cpus_allowed_list"):
        parse_status_thread("Name:\tx\n")


NUMA_MAPS = """\
55d0c0a00000 default file=/usr/bin/python3.11 mapped=100 mapmax=2 N0=100 kernelpagesize_kB=4
7f0000000000 default anon=2560 dirty=2560 N0=2048 N1=512 kernelpagesize_kB=4
7f1000000000 bind:1 anon=3 dirty=3 N1=3 kernelpagesize_kB=2048
7f2000000000 interleave:0-1 file=/dev/hugepages/x huge dirty=1 N0=1 kernelpagesize_kB=1048576
7ffd00000000 default stack anon=33 dirty=33 N0=33 kernelpagesize_kB=4
7ffd10000000 default
"""


def test_parse_numa_maps_honours_page_sizes() -> None:
    by_node = parse_numa_maps(NUMA_MAPS)
    # The python binary's file pages are shared page cache, not allocated: left out.
    assert by_node == {
        0: (2048 + 33) * 4096 + 1 * (1 << 30),
        1: 512 * 4096 + 3 * 2 * MIB,
    }
    assert parse_numa_maps("") == {}
    # Shared anonymous memory (mmap(-1) in Python) shows as /dev/zero: allocated, counted.
    shared = "7f00 default file=/dev/zero\\040(deleted) dirty=4 N1=4 kernelpagesize_kB=4\n"
    assert parse_numa_maps(shared) == {1: 4 * 4096}
    model = "7f00 default file=/models/w.safetensors mapped=9 N1=9 kernelpagesize_kB=4\n"
    assert parse_numa_maps(model) == {}
    # Without kernelpagesize_kB (old kernels), the default page size counts.
    assert parse_numa_maps("7f00 default anon=2 N3=2\n", default_page_bytes=16384) == {3: 32768}


def test_local_memory_ratio() -> None:
    assert local_memory_ratio({}, [0]) is None
    assert local_memory_ratio({0: 0}, [0]) is None
    assert local_memory_ratio({0: 300, 1: 100}, [0]) == 0.75
    assert local_memory_ratio({0: 300, 1: 100}, [0, 1]) == 1.0
    assert local_memory_ratio({1: 100}, [0]) == 0.0


def test_numa_maps_of_a_child_touching_64_mib() -> None:
    with ThreadedChild([], touch_bytes=0) as base, ThreadedChild([], touch_bytes=64 * MIB) as big:
        base_bytes = read_numa_maps(LIVE, base.pid)
        big_bytes = read_numa_maps(LIVE, big.pid)
    assert set(big_bytes) == {0}  # one NUMA node on this host
    extra = big_bytes[0] - base_bytes.get(0, 0)
    assert 60 * MIB <= extra <= 72 * MIB, extra / MIB
    assert local_memory_ratio(big_bytes, [0]) == 1.0
    assert local_memory_ratio(big_bytes, [1]) == 0.0


@pytest.mark.vm
@pytest.mark.timeout(900)
def test_numa_maps_in_vm() -> None:
    """A child bound to node 1 by numactl, planned on node 0: inside the 2-node guest."""
    run_checks_in_vm("tests/vm_checks/observe_numa.py", OBSERVE_NUMA, timeout_s=300)


def test_read_numa_maps_gone_process() -> None:
    c = ThreadedChild([])
    pid = c.pid
    c.close()
    with pytest.raises(Gone):
        read_numa_maps(LIVE, pid)


def test_read_irq_delivery_live_and_tree(tmp_path: Path) -> None:
    irqs = [int(n) for n in os.listdir("/proc/irq") if n.isdigit()]
    irq = irqs[0]
    with open(f"/proc/irq/{irq}/effective_affinity_list") as f:
        text = f.read().strip()
    with open(f"/proc/irq/{irq}/smp_affinity_list") as f:
        mask = parse_cpulist(f.read())
    live = read_irq_delivery(LIVE, irq)
    if text and parse_cpulist(text) <= mask:
        assert live == tuple(sorted(parse_cpulist(text)))
    assert read_irq_delivery(LIVE, 1 << 20) is None
    (tmp_path / "proc/irq/41").mkdir(parents=True)
    (tmp_path / "proc/irq/41/effective_affinity_list").write_text("\n")
    (tmp_path / "proc/irq/41/smp_affinity_list").write_text("2-3\n")
    (tmp_path / "proc/irq/42").mkdir(parents=True)
    (tmp_path / "proc/irq/42/effective_affinity_list").write_text("5\n")
    (tmp_path / "proc/irq/42/smp_affinity_list").write_text("4-7\n")
    fs = HostFS(str(tmp_path))
    assert read_irq_delivery(fs, 41) == (2, 3)  # empty effective: fall back
    assert read_irq_delivery(fs, 42) == (5,)
    assert read_irq_delivery(fs, 43) is None


def test_read_self_allowed_live() -> None:
    cpus, mems = read_self_allowed(LIVE)
    assert cpus == frozenset(os.sched_getaffinity(0))
    assert 0 in mems
    assert read_online_cpus(LIVE) >= cpus


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_read_self_allowed_narrowed_by_cgroup(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "proc/self/status",
        "Name:\tx\nCpus_allowed_list:\t0-15\nMems_allowed_list:\t0-1\n",
    )
    _write(tmp_path, "proc/self/cgroup", "12:cpuset:/job\n11:memory:/job\n0::/\n")
    _write(tmp_path, "sys/fs/cgroup/cpuset/job/cpuset.effective_cpus", "2-5,8\n")
    _write(tmp_path, "sys/fs/cgroup/cpuset/job/cpuset.effective_mems", "1\n")
    fs = HostFS(str(tmp_path))
    assert read_self_allowed(fs) == (frozenset({2, 3, 4, 5, 8}), frozenset({1}))
    # v2 only
    _write(tmp_path, "proc/self/cgroup", "0::/svc\n")
    _write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu memory\n")
    _write(tmp_path, "sys/fs/cgroup/svc/cpuset.cpus.effective", "0-3\n")
    _write(tmp_path, "sys/fs/cgroup/svc/cpuset.mems.effective", "0-1\n")
    assert read_self_allowed(fs) == (frozenset(range(4)), frozenset({0, 1}))
    _write(tmp_path, "sys/devices/system/cpu/online", "0-7,12\n")
    assert read_online_cpus(fs) == frozenset([*range(8), 12])


def test_cached_cpuset_read_follows_writes_moves_and_removals(tmp_path: Path) -> None:
    """The pass's cached read: the files are found once, their contents read every
    time; a move to another cgroup, a mount change or a vanished file finds them again."""
    _write(
        tmp_path,
        "proc/self/status",
        "Name:\tx\nCpus_allowed_list:\t0-15\nMems_allowed_list:\t0-1\n",
    )
    _write(tmp_path, "proc/self/cgroup", "12:cpuset:/job\n0::/\n")
    _write(
        tmp_path,
        "proc/self/mountinfo",
        "30 20 0:26 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n",
    )
    _write(tmp_path, "sys/fs/cgroup/cpuset/job/cpuset.effective_cpus", "2-5\n")
    _write(tmp_path, "sys/fs/cgroup/cpuset/job/cpuset.effective_mems", "1\n")
    _write(tmp_path, "sys/fs/cgroup/cpuset/other/cpuset.effective_cpus", "6\n")
    _write(tmp_path, "sys/fs/cgroup/cpuset/other/cpuset.effective_mems", "0\n")
    fs = HostFS(str(tmp_path))
    cache = CpusetCache()
    for _ in range(3):
        assert read_self_allowed(fs, cache) == (frozenset(range(2, 6)), frozenset({1}))
    assert cache.resolves == 1
    _write(tmp_path, "sys/fs/cgroup/cpuset/job/cpuset.effective_cpus", "3\n")  # a cpuset write
    assert read_self_allowed(fs, cache) == (frozenset({3}), frozenset({1}))
    assert cache.resolves == 1
    _write(tmp_path, "proc/self/cgroup", "12:cpuset:/other\n0::/\n")  # moved
    assert read_self_allowed(fs, cache) == (frozenset({6}), frozenset({0}))
    assert cache.resolves == 2
    # Its cgroup removed under it (the kernel moves it to the parent, which this
    # fixture leaves unsaid): the read fails, the walk up finds the parent.
    (tmp_path / "sys/fs/cgroup/cpuset/other/cpuset.effective_cpus").unlink()
    _write(tmp_path, "sys/fs/cgroup/cpuset/cpuset.effective_cpus", "0-7\n")
    _write(tmp_path, "sys/fs/cgroup/cpuset/cpuset.effective_mems", "0-1\n")
    assert read_self_allowed(fs, cache) == (frozenset(range(8)), frozenset({0, 1}))
    assert cache.resolves == 3
    _write(
        tmp_path,
        "proc/self/mountinfo",
        "31 20 0:27 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n",
    )
    read_self_allowed(fs, cache)
    assert cache.resolves == 4  # a mount change
    # The same as the uncached read all along, and found again now and then anyway.
    assert read_self_allowed(fs, cache) == read_self_allowed(fs)
    for _ in range(CPUSET_RESOLVE_EVERY):
        read_self_allowed(fs, cache)
    assert cache.resolves == 5


def test_parse_status_allowed_finds_its_two_lines() -> None:
    text = "Name:\tx\nCpus_allowed:\tff\nCpus_allowed_list:\t0-7\nMems_allowed_list:\t0\n"
    assert parse_status_allowed(text) == (frozenset(range(8)), frozenset({0}))
    assert parse_status_allowed("Cpus_allowed_list:\t1\nMems_allowed_list:\t0-1") == (
        frozenset({1}),
        frozenset({0, 1}),
    )
    with pytest.raises(TopologyError, match="no Mems_allowed_list line"):
        parse_status_allowed("Cpus_allowed_list:\t1\nMems_allowed:\t1\n")
    live = LIVE.read_text("proc/self/status")
    cpus, _ = parse_status_allowed(live)
    assert cpus == frozenset(os.sched_getaffinity(0))


def test_observe_process_live(child: ThreadedChild) -> None:
    allowed = tuple(sorted(os.sched_getaffinity(child.pid)))
    slot = Slot(allowed, (0,), {"main": allowed, "acl": allowed[-1:]})
    roles = (ThreadRole("acl", "workers", "acl_thread"), ThreadRole("rel", "workers", "release*"))
    irq = int(next(n for n in sorted(os.listdir("/proc/irq")) if n.isdigit()))
    obs = observe_process(
        LIVE,
        child.pid,
        slot,
        "workers",
        roles=roles,
        numa_maps=True,
        irqs={irq: allowed},
        scanner=ThreadScanner(LIVE, child.pid),
        now=123.0,
    )
    roles_by_tid = {t.tid: t.role for t in obs.threads}
    assert roles_by_tid[child.threads["acl_thread"]] == "acl"
    assert roles_by_tid[child.threads["release_thread"]] == "rel"
    assert roles_by_tid[child.threads["so-compile-0"]] == "main"  # engine roles don't apply
    assert obs.local_memory_ratio == 1.0
    assert obs.memory_bytes_by_node[0] > 0
    assert obs.irqs[0].irq == irq and obs.irqs[0].planned == allowed
    assert obs.observed_at == 123.0
    # Without a memory source this check, the previous one carries over.
    again = observe_process(LIVE, child.pid, slot, "workers", roles=roles, previous=obs)
    assert again.memory_bytes_by_node == obs.memory_bytes_by_node
    assert (
        observe_process(
            LIVE, child.pid, slot, "workers", numa_stat={0: 10, 1: 30}
        ).local_memory_ratio
        == 0.25
    )
    child.close()
    with pytest.raises(Gone):
        observe_process(LIVE, child.pid, slot, "workers", roles=roles)
