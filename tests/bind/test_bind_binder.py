"""Binder: per-thread affinity of real processes, page migration, CAP_SYS_NICE."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.bind.binder import Binder, parse_cap_eff
from supervisor.cpulist import parse_cpulist
from supervisor.errors import Gone, Invalid
from supervisor.hostfs import HostFS
from tests.support.children import ThreadedChild, mems_allowed, status_field


@pytest.fixture
def threaded_child() -> Iterator[ThreadedChild]:
    with ThreadedChild(["t0", "t1", "t2"]) as child:
        yield child


def test_set_process_affinity_binds_every_thread(threaded_child: ThreadedChild) -> None:
    binder = Binder()
    target = max(os.sched_getaffinity(0))
    tids = binder.thread_ids(threaded_child.pid)
    assert len(tids) >= 4  # main + 3 threads
    result = binder.set_process_affinity(threaded_child.pid, {target})
    assert result.ok
    assert set(result.bound) == set(tids)
    for tid in tids:
        assert result.bound[tid] == {target}
        # What the kernel shows for the thread, not what we asked for.
        shown = status_field(f"{threaded_child.pid}/task/{tid}", "Cpus_allowed_list")
        assert parse_cpulist(shown) == {target}
        assert binder.get_thread_affinity(tid) == {target}


def test_set_thread_affinity_one_thread_only(threaded_child: ThreadedChild) -> None:
    binder = Binder()
    allowed = frozenset(os.sched_getaffinity(0))
    tids = binder.thread_ids(threaded_child.pid)
    one = min(allowed)
    assert binder.set_thread_affinity(tids[-1], {one}) == {one}
    assert binder.get_thread_affinity(tids[0]) == allowed


def test_gone_thread_and_process_name_the_target() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    binder = Binder()
    with pytest.raises(Gone) as info:
        binder.set_thread_affinity(child.pid, {0})
    assert info.value.target == f"tid {child.pid}"
    with pytest.raises(Gone) as info:
        binder.set_process_affinity(child.pid, {0})
    assert info.value.target == f"pid {child.pid}"


def test_cpus_outside_the_cpuset_are_invalid(threaded_child: ThreadedChild) -> None:
    binder = Binder()
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    with pytest.raises(Invalid) as info:
        binder.set_thread_affinity(threaded_child.pid, {max(online) + 1})
    assert info.value.errno_name == "EINVAL"
    result = binder.set_process_affinity(threaded_child.pid, {max(online) + 1})
    assert not result.ok
    assert all(err.reason == "invalid" for err in result.failed.values())


def test_migrate_pages_of_a_child(threaded_child: ThreadedChild) -> None:
    node = min(mems_allowed())
    assert Binder().migrate_pages(threaded_child.pid, {node}, {node}) == 0


def test_can_migrate_other_reads_cap_sys_nice(tmp_path: Path) -> None:
    status = tmp_path / "proc/self/status"
    status.parent.mkdir(parents=True)
    status.write_text("Name:\tx\nCapEff:\t0000000000800000\n")  # bit 23 only
    assert Binder(HostFS(str(tmp_path))).can_migrate_other()
    status.write_text("Name:\tx\nCapEff:\t00000000007fffff\n")  # everything below 23
    assert not Binder(HostFS(str(tmp_path))).can_migrate_other()
    assert not Binder(HostFS(str(tmp_path / "missing"))).can_migrate_other()
    assert parse_cap_eff("CapEff:\t000001ffffffffff\n") == 0x1FFFFFFFFFF


def test_can_migrate_other_matches_the_live_process() -> None:
    live = Binder().can_migrate_other()
    cap = parse_cap_eff(Path("/proc/self/status").read_text())
    assert live == bool(cap >> 23 & 1)
    if os.geteuid() == 0:
        assert live
