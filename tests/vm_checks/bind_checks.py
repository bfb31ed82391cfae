"""Binding checks that need a multi-NUMA kernel; run INSIDE the test guest (as root).

    tests/guest/run-in-vm --nodes 2 -- .venv/bin/python -u tests/vm_checks/bind_checks.py

Expects the default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3, cgroup v2 at
/sys/fs/cgroup. Prints one "PASS name: detail" or "FAIL name: detail" line per
check and exits 1 if any failed. tests/bind/test_bind_vm.py asserts on those lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from supervisor.bind.binder import Binder
from supervisor.bind.cgroup import CgroupManager, ProcessCgroup, read_cgroup_setup
from supervisor.bind.report import ShimReport
from supervisor.hostfs import HostFS
from tests.support.children import start_shimmed
from tests.support.poll import wait_until
from tests.support.vm import Checklist

MIB = 1 << 20
SIZE = 64 * MIB
CHECKS = Checklist()

# Allocates and touches `size` bytes of anonymous memory (4 KiB pages, its own
# VMA), then prints its Cpus/Mems_allowed_list, the mapping's address, and the
# per-node page counts of every anonymous mapping (heap, stack, mmap); waits for
# a line on stdin.
WORKER = r"""
import mmap, re, sys
size = int(sys.argv[1])
buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
buf.madvise(mmap.MADV_NOHUGEPAGE)
for off in range(0, size, mmap.PAGESIZE):
    buf[off] = 1
import ctypes
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
anon = {}
for line in open("/proc/self/numa_maps"):
    # Anonymous mappings only: a private file mapping's line mixes its
    # page-cache pages (shared, wherever the file was first read) with its COW copies.
    if " anon=" in line and " file=" not in line:
        for node, pages in re.findall(r" N(\d+)=(\d+)", line):
            anon[int(node)] = anon.get(int(node), 0) + int(pages)
print(status["Cpus_allowed_list"].strip(), status["Mems_allowed_list"].strip(),
      "%x" % addr, ",".join(f"{n}:{p}" for n, p in sorted(anon.items())), flush=True)
sys.stdin.readline()
"""


def start_worker(
    cpus: list[int], mems: list[int], *, cgroups: tuple[str, ...] = (), size: int = SIZE
) -> tuple[subprocess.Popen[str], ShimReport, list[str]]:
    proc, report = start_shimmed(
        cpus,
        mems,
        [sys.executable, "-c", WORKER, str(size)],
        shim={"cgroups": cgroups, "parent_pid": os.getpid()},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    return proc, report, proc.stdout.readline().split()


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
    proc.wait(timeout=60)


def mapping_pages(pid: int, addr: int) -> dict[int, int]:
    start = None
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                start = f"{lo:x}"
    with open(f"/proc/{pid}/numa_maps") as f:
        for line in f:
            if line.split()[0] == start:
                return {int(n): int(p) for n, p in re.findall(r" N(\d+)=(\d+)", line)}
    return {}


@CHECKS.guarded("shim-worker-on-node1")
def shim_worker_on_node1() -> None:
    proc, rep, out = start_worker([2, 3], [1])
    try:
        cpus, mems, _, anon = out
        by_node = dict((int(n), int(p)) for n, p in (x.split(":") for x in anon.split(",")))
        ok = (
            rep.mempolicy == "bind"
            and rep.cpus == (2, 3)
            and rep.mems == (1,)
            and cpus == "2-3"
            and set(by_node) == {1}
            and by_node[1] >= SIZE // 4096
        )
        CHECKS.check(
            "shim-worker-on-node1",
            ok,
            f"report cpus={rep.cpus} mems={rep.mems} policy={rep.mempolicy}; "
            f"child Cpus_allowed_list={cpus} Mems_allowed_list={mems} anon pages by node={by_node}",
        )
    finally:
        stop(proc)


@CHECKS.guarded("migrate-pages-other-process")
def migrate_other() -> None:
    proc, _, out = start_worker([0, 1], [0])
    try:
        addr = int(out[2], 16)
        before = mapping_pages(proc.pid, addr)
        binder = Binder()
        t = time.monotonic()
        left = binder.migrate_pages(proc.pid, {0}, {1})
        dt = time.monotonic() - t
        after = mapping_pages(proc.pid, addr)
        total = sum(after.values())
        ratio = after.get(1, 0) / total if total else 0.0
        ok = before.get(0, 0) >= SIZE // 4096 and ratio >= 0.99 and binder.can_migrate_other()
        CHECKS.check(
            "migrate-pages-other-process",
            ok,
            f"before={before} after={after} ratio_node1={ratio:.4f} not_moved={left} in {dt:.2f}s",
        )
    finally:
        stop(proc)


def join_service_cgroup() -> None:
    """This process into `/ps-bind` (cpuset and memory enabled above it), as a service
    manager with `Delegate=yes` would start it: the host's root is never used."""
    with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
        f.write("+cpuset +memory")
    os.makedirs(f"/sys/fs/cgroup/{SERVICE}", exist_ok=True)
    with open(f"/sys/fs/cgroup/{SERVICE}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))


SERVICE = "ps-bind"


@CHECKS.guarded("cgroup-v2-rank")
def cgroup_v2_rank() -> None:
    fs = HostFS("/")
    join_service_cgroup()
    setup, why = read_cgroup_setup(fs)
    if setup is None or setup.version != 2:
        CHECKS.check("cgroup-v2-rank", False, f"no v2 setup: {why}")
        return
    mgr = CgroupManager(fs, setup, suffix="vmcheck")
    pc: ProcessCgroup | None = None
    proc = None
    try:
        pc = mgr.create("rank1", [2, 3], [1])
        eff = mgr.read_effective(pc)
        proc, rep, out = start_worker([2, 3], [1], cgroups=pc.dirs, size=32 * MIB)
        cpus, mems = out[0], out[1]
        with open(f"/proc/{proc.pid}/cgroup") as f:
            cg = f.read().strip()
        stat_before = mgr.read_numa_stat(pc)
        ok1 = (
            eff == ({2, 3}, {1})
            and cpus == "2-3"
            and mems == "1"
            and rep.cgroups == pc.dirs
            and not rep.cgroup_errors
            and cg == f"0::/{SERVICE}/{mgr.instance}/rank1"
            and stat_before.get(1, 0) >= 32 * MIB
            and stat_before.get(0, 0) < 4 * MIB
        )
        CHECKS.check(
            "cgroup-v2-rank",
            ok1,
            f"setup={setup.cpuset_parent} evict_self={setup.evict_self} effective={eff} "
            f"child cpus={cpus} mems={mems} cgroup={cg} numa_stat={stat_before}",
        )
        # Moving the cgroup to node 0 migrates its pages (v2 always migrates).
        mgr.update(pc, [0, 1], [0])
        wait_until(lambda: mgr.read_numa_stat(pc).get(0, 0) >= 32 * MIB, 30)
        stat_after = mgr.read_numa_stat(pc)
        with open(f"/proc/{proc.pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        ok2 = (
            stat_after.get(0, 0) >= 32 * MIB
            and stat_after.get(1, 0) < 4 * MIB
            and status["Cpus_allowed_list"].strip() == "0-1"
            and status["Mems_allowed_list"].strip() == "0"
        )
        CHECKS.check(
            "cgroup-v2-update-migrates",
            ok2,
            f"numa_stat after cpuset.mems 1->0: {stat_after}; "
            f"Cpus_allowed_list={status['Cpus_allowed_list'].strip()}",
        )
    finally:
        if proc is not None:
            stop(proc)
        if pc is not None:
            mgr.remove(pc)
            CHECKS.check("cgroup-v2-remove", not fs.exists(pc.cpuset_dir), pc.cpuset_dir)
        mgr.close()


@CHECKS.guarded("mempolicy-ladder")
def mempolicy_ladder() -> None:
    # A cgroup confined to node 0; the plan asks for node 1: MPOL_BIND gets
    # EINVAL (outside Mems_allowed); the worker still starts.
    fs = HostFS("/")
    setup, _ = read_cgroup_setup(fs)
    assert setup is not None
    mgr = CgroupManager(fs, setup, suffix="vmladder")
    pc = mgr.create("confined", [0, 1], [0])
    proc = None
    try:
        proc, rep, out = start_worker([0, 1], [1], cgroups=pc.dirs, size=MIB)
        ok = (
            rep.mempolicy in ("preferred", "none")
            and rep.reason is not None
            and "EINVAL" in rep.reason
            and out[1] == "0"
        )
        CHECKS.check(
            "mempolicy-ladder",
            ok,
            f"step={rep.mempolicy} reason={rep.reason!r} child Mems_allowed_list={out[1]}",
        )
    finally:
        if proc is not None:
            stop(proc)
        mgr.remove(pc)
        mgr.close()


def main() -> int:
    if os.environ.get("PS_GUEST") != "1":
        print("note: meant to run inside run-in-vm", file=sys.stderr)
    for fn in (shim_worker_on_node1, migrate_other, cgroup_v2_rank, mempolicy_ladder):
        fn()
    failed = CHECKS.failed
    print(f"{'FAILED ' + ' '.join(failed) if failed else 'ALL PASSED'}", flush=True)
    return CHECKS.exit_code()


if __name__ == "__main__":
    sys.exit(main())
