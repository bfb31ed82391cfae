"""The guardian is watched (issue 30 item 8): SIGKILLed under a real daemon, it is
logged and replaced within a check, and the new one is told every cgroup and
tree member the old one knew; a later SIGKILL of the daemon then leaves no
escapee (a setsid grandchild of a worker) and no cgroup dir.

Before, a SIGKILLed guardian was neither logged nor replaced, and a later
daemon SIGKILL left the grandchild running and the instance's cgroup dirs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.procfs.identity import ProcessId
from supervisor.trees.guardian import GUARDIAN_TAG, Guardian
from tests.support.cgroup_v1 import own_memory_cgroup, remove_v1_tree, v1_available, v1_cpuset
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    rank_pids,
    write_cpuset_config,
)
from tests.support.poll import poll

pytestmark = pytest.mark.root

# A worker that starts a grandchild in a session of its own (torchrun's
# start_new_session workers): the kernel's PDEATHSIG never reaches it; only the
# guardian (its cgroup, its pid) ends it when the daemon dies unclean.
WORKER = r"""
import os, subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True
)
open(sys.argv[2] + ".tmp", "w").write(str(child.pid))
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(3600)
"""


def guardians_of(daemon_pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            words = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if GUARDIAN_TAG.encode() in words and ppid == daemon_pid:
            out.append(int(name))
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(120)
def test_a_killed_guardian_is_replaced_and_the_new_one_ends_the_trees(tmp_path: Path) -> None:
    why = v1_available()
    memory = own_memory_cgroup()
    if why is not None or memory is None:
        pytest.skip(why or "no v1 memory cgroup")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    grandchild_file = tmp_path / "grandchild"
    interval_s = 0.2
    config = write_cpuset_config(tmp_path, ranks=1, threads=0, interval_s=interval_s, worker=worker)
    # The worker's argv[2]: where to write its grandchild's pid.
    text = config.read_text().replace('"0"]', f'"0", "{grandchild_file}"]')
    config.write_text(text)
    suffix = f"guardian-{os.getpid()}"
    instance = memory / f"placement-supervisor-{suffix}"
    env = dict(os.environ, **{INSTANCE_ENV: suffix})
    grandchild = 0
    with v1_cpuset(f"ps-{suffix}") as cg:
        d = DaemonProcess(config, tmp_path / "daemon.log", env=env, join=[cg / "cgroup.procs"])
        try:
            doc = poll(lambda: (p := d.placement()) and rank_pids(p) and p, 30, what=d.tail())
            worker_pid = rank_pids(doc)[0]
            poll(grandchild_file.exists, 30, what="the grandchild started")
            grandchild = int(grandchild_file.read_text())
            assert running(grandchild)
            # The keeper told the guardian the grandchild (a tree member): wait for
            # /placement to list it so the old guardian knew it before it dies.
            old = poll(lambda: guardians_of(d.pid), 10, what="the guardian")
            assert len(old) == 1
            os.kill(old[0], signal.SIGKILL)
            new = poll(
                lambda: [g for g in guardians_of(d.pid) if g != old[0]],
                10 * interval_s + 5,
                what=d.tail(),
            )
            assert len(new) == 1
            log = d.tail(20000)
            assert f"guardian gone pid={old[0]}" in log, log
            assert f"guardian replaced old={old[0]} pid={new[0]}" in log, log
            # The daemon dies unclean: the new guardian ends what the old one knew.
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            poll(lambda: not running(grandchild) and not running(worker_pid), 15, what="ended")
            poll(lambda: not instance.exists(), 15, what=f"{instance} removed")
            poll(lambda: not running(new[0]), 15, what="the guardian done")
        finally:
            d.stop()
            if grandchild:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(grandchild, signal.SIGKILL)
            remove_v1_tree(instance, memory)


def test_the_new_guardian_is_told_what_the_old_one_knew(tmp_path: Path) -> None:
    """Without a daemon: a real Guardian told a member, SIGKILLed, replaced; the
    pipe then closed without "bye" (the daemon's death) and the member ends."""
    guardian = Guardian.start()
    assert guardian is not None
    member = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True
    )
    try:
        stat = Path(f"/proc/{member.pid}/stat").read_text().rsplit(")", 1)[1].split()
        guardian.process(ProcessId(member.pid, int(stat[19])))  # field 22, starttime (proc(5))
        assert guardian.replace_if_dead() is None  # alive: nothing to do
        old = guardian.pid
        os.kill(old, signal.SIGKILL)
        assert poll(guardian.replace_if_dead, 10, what="the death seen") == old
        assert guardian.pid != old and guardian.replaced == 1
        assert guardian.proc.stdin is not None
        guardian.proc.stdin.close()  # as a SIGKILLed daemon: EOF, no "bye"
        poll(lambda: member.poll() is not None, 15, what="the member ended by the new guardian")
        assert member.returncode == -signal.SIGKILL
        guardian.proc.wait(15)
    finally:
        member.kill()
        member.wait()
        guardian.proc.kill()
        guardian.proc.wait()
