"""Orphans no tree pass saw are reaped; a runner's own exited child is not;
`any_zombie_child` says whether any is waiting, and leaves it waitable
(supervisor.trees.strays, in a real child subreaper: a subprocess, so the test
process itself stays what it was). And a child pid namespace, where the proc
connector is of no use, is recognised (supervisor.trees.proc_events)."""

from __future__ import annotations

import os
import subprocess
import sys

from supervisor.trees.proc_events import nested_pid_namespace
from tests.support.daemon_support import REPO

SUBREAPER = r"""
import ctypes, os, sys, time
from supervisor.hostfs import HostFS
from supervisor.procfs.stat import read_proc_stat
from supervisor.bind.syscalls import set_child_subreaper
from supervisor.trees.strays import any_zombie_child, exited_children, reap_strays

assert set_child_subreaper()
fs, me = HostFS("/"), os.getpid()
assert not any_zombie_child()  # no child at all
own = os.fork()  # "a runner's child": exits at once, its status is the runner's
if own == 0:
    os._exit(7)
orphans = []
for _ in range(3):
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        if os.fork() == 0:  # the grandchild: re-parented to us once the middle exits
            os.close(r)
            while os.getppid() != me:
                time.sleep(0.001)
            os.write(w, str(os.getpid()).encode())
            os._exit(0)
        os._exit(0)
    os.close(w)
    os.waitpid(middle, 0)
    orphans.append(int(os.read(r, 32)))
    os.close(r)

def zombie(pid):
    stat = read_proc_stat(fs, pid)
    return stat is not None and stat.state == "Z"

deadline = time.monotonic() + 10
while not all(map(zombie, [own, *orphans])):
    assert time.monotonic() < deadline, "never zombies"
    time.sleep(0.01)
assert any_zombie_child()
assert sorted(exited_children(fs, me, {own})) == sorted(orphans)
assert sorted(reap_strays(fs, me, {own})) == sorted(orphans)
assert not any(map(zombie, orphans)) and zombie(own)  # the runner's child: still there
assert reap_strays(fs, me, {own}) == []
assert any_zombie_child()  # the runner's child: WNOWAIT left it waitable
assert os.waitpid(own, 0)[1] >> 8 == 7  # its exit status kept for its runner
assert not any_zombie_child()  # every zombie reaped: a reap reads nothing now
print("ok")
"""


def test_strays_are_reaped_and_a_runner_s_child_is_left_to_its_runner() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SUBREAPER],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_child_pid_namespace_is_told_by_its_ns_link() -> None:
    assert not nested_pid_namespace("pid:[4026531836]")  # the initial one, always this inode
    assert nested_pid_namespace("pid:[4026532291]")  # a container's
    assert not nested_pid_namespace(None)  # a fixture root without the link
    assert not nested_pid_namespace(os.readlink("/proc/self/ns/pid"))  # this test, on the host
