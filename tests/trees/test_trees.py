"""Process trees and no orphans, with real processes and a real daemon (contracts §6, issue 11.2).

The engine and the worker below each start a `setsid` grandchild that
ignores SIGTERM and an orphan (a child that exits after forking), every one
carrying a marker argument unique to the test, so the tests can poll /proc
for survivors. The pure owner assignment and the proc connector's parser
are tested on tables and bytes made here.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from supervisor.bind.cgroup import CgroupManager, detect_cgroup_setup
from supervisor.hostfs import HostFS
from supervisor.procfs.files import read_cmdline
from supervisor.procfs.identity import ProcessId
from supervisor.procfs.stat import ProcStat, read_proc_stat
from supervisor.trees.guardian import live_guardian, sweep_leftovers
from supervisor.trees.proc_events import (
    PROC_EVENT_COMM,
    PROC_EVENT_EXEC,
    PROC_EVENT_EXIT,
    PROC_EVENT_FORK,
    RECV_BYTES,
    RawEvent,
    listen_message,
    open_proc_events,
    parse_proc_events,
    raw_event,
    read_raw_events,
)
from supervisor.trees.tree import Member, Root, assign_owners
from tests.support.cgroup_v1 import own_memory_cgroup
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

FS = HostFS("/")
CPUSET = Path("/sys/fs/cgroup/cpuset")

TREE_CHILD = r"""
import os, signal, subprocess, sys, time
marker, role = sys.argv[1], sys.argv[2]
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"
# A setsid grandchild that ignores TERM: neither PDEATHSIG nor a group kill reaches it.
subprocess.Popen([sys.executable, "-c", stubborn, marker, role + "-setsid"], start_new_session=True)
# An orphan: its parent exits at once, so it is reparented (to the daemon, a subreaper).
orphan = "import os, time\nif os.fork() == 0:\n    time.sleep(3600)\n"
subprocess.run([sys.executable, "-c", orphan, marker, role + "-orphan"], check=True)
# An orphan that exits soon: the daemon, now its parent, must reap it (no zombie).
brief = "import os, time\nif os.fork() == 0:\n    time.sleep(1.5)\n"
subprocess.run([sys.executable, "-c", brief, marker, role + "-brief"], check=True)
if len(sys.argv) > 3:
    open(sys.argv[3], "w").close()
time.sleep(3600)
"""


def stat(pid: int, ppid: int, start: int = 100) -> ProcStat:
    return ProcStat(pid, "p", "S", ppid, pid, 0, 0, start)


# -- owner assignment (pure) -------------------------------------------------------------


def test_assign_owners_follows_ppid_and_stops_at_other_roots() -> None:
    table = {
        s.pid: s
        for s in (
            stat(1, 0),
            stat(10, 1),  # the daemon
            stat(20, 10),  # engine
            stat(21, 20),  # torchrun worker (setsid: same parent)
            stat(22, 21),  # the worker's own child
            stat(23, 20),  # another engine child
            stat(30, 10),  # the guardian: excluded
            stat(40, 10),  # an orphan reparented to the daemon, known from before
        )
    }
    roots = [
        Root("engine", 20, ProcessId(20, 100)),
        Root(0, 21, ProcessId(21, 100)),
    ]  # rank 0 adopted pid 21
    known = {40: Member(ProcessId(40, 100), 20, "engine")}
    owners = assign_owners(table, roots, known, {}, exclude={10, 30})
    assert {pid: m.owner for pid, m in owners.items()} == {22: 0, 23: "engine", 40: "engine"}


def test_assign_owners_uses_cgroup_members_and_drops_reused_pids() -> None:
    table = {s.pid: s for s in (stat(20, 1), stat(50, 1), stat(51, 50), stat(60, 1, start=999))}
    roots = [Root("engine", 20, ProcessId(20, 100))]
    known = {60: Member(ProcessId(60, 100), 20, "engine")}  # pid 60 was reused (other start time)
    owners = assign_owners(table, roots, known, {"engine": [50]})
    assert sorted(owners) == [50, 51]
    # A root whose pid was reused is no root.
    assert assign_owners(table, [Root("engine", 20, ProcessId(20, 7))], {}, {}) == {}


# -- the proc connector -------------------------------------------------------------------


def _message(what: int, payload: bytes) -> bytes:
    event = struct.pack("=IIQ", what, 0, 123) + payload
    cn = struct.pack("=IIIIHH", 1, 1, 0, 0, len(event), 0) + event
    return struct.pack("=IHHII", 16 + len(cn), 3, 0, 0, 0) + cn


def test_parse_proc_events_reads_fork_and_exit_and_skips_garbage() -> None:
    data = _message(PROC_EVENT_FORK, struct.pack("=iiii", 5, 5, 7, 7))
    data += _message(PROC_EVENT_EXIT, struct.pack("=iiII", 9, 8, 0, 17))
    data += _message(0x40, b"")  # an event kind we do not use
    events = parse_proc_events(data + b"\x01\x02", threads=True)
    assert [(e.kind, e.pid, e.tgid, e.parent_tgid) for e in events] == [
        ("fork", 7, 7, 5),
        ("exit", 9, 8, 0),
    ]
    assert events[0].is_process and not events[1].is_process
    # By default a thread's events (tid 9 of process 8) are dropped.
    assert [e.kind for e in parse_proc_events(data)] == ["fork"]
    assert len(listen_message(1)) == 16 + 20 + 4


def _sized(what: int, ints: tuple[int, ...]) -> bytes:
    """A datagram the size the kernel sends: the union padded to 24 bytes."""
    return _message(what, struct.pack(f"={len(ints)}i", *ints).ljust(24, b"\0"))


def test_read_raw_events_reads_what_parse_proc_events_reads() -> None:
    datagrams = [
        _sized(PROC_EVENT_FORK, (5, 5, 7, 7)),  # a process
        _sized(PROC_EVENT_FORK, (5, 5, 8, 7)),  # a thread of 7: dropped
        _sized(PROC_EVENT_EXEC, (7, 7)),
        _sized(PROC_EVENT_EXEC, (8, 7)),  # a thread: dropped
        _sized(PROC_EVENT_COMM, (7, 7)),
        _sized(PROC_EVENT_EXIT, (7, 7, 0, 17)),
        _sized(0x40, (7, 7)),  # a kind the keeper does not use: dropped
        _message(PROC_EVENT_EXEC, struct.pack("=ii", 9, 9)),  # short: the slow path
        _sized(PROC_EVENT_FORK, (9, 9, 10, 10)) + _sized(PROC_EVENT_EXIT, (10, 10, 0, 0)),
        b"\x01\x02",  # garbage
    ]
    want = [raw_event(e) for d in datagrams for e in parse_proc_events(d)]
    assert want == [
        (PROC_EVENT_FORK, 7, 5),
        (PROC_EVENT_EXEC, 7, 0),
        (PROC_EVENT_COMM, 7, 0),
        (PROC_EVENT_EXIT, 7, 0),
        (PROC_EVENT_EXEC, 9, 0),
        (PROC_EVENT_FORK, 10, 9),
        (PROC_EVENT_EXIT, 10, 0),
    ]
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with reader, writer:
        reader.setblocking(False)
        for d in datagrams:
            writer.send(d)
        buf = bytearray(RECV_BYTES)
        got: list[RawEvent] = []
        assert read_raw_events(reader.recv_into, buf, got, 3) == 0  # three datagrams at most
        assert got == want[:2]
        read_raw_events(reader.recv_into, buf, got, 100)  # the rest, until it would block
        assert got == want


THREADED = "import threading; t = threading.Thread(target=len, args=((),)); t.start(); t.join()"


def connector_events(filtered: bool) -> set[tuple[str, bool]]:
    """(kind, is_process) of the events of one real child that starts a thread."""
    events, why = open_proc_events(filtered=filtered)
    assert events is not None, why
    seen: set[tuple[str, bool]] = set()
    try:
        events.sock.settimeout(0.2)
        child = subprocess.Popen([sys.executable, "-c", THREADED])
        child.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(seen) < 5:
            try:
                data = events.sock.recv(65536)
            except TimeoutError:
                continue
            for ev in parse_proc_events(data, threads=True):
                if ev.tgid == child.pid:
                    seen.add((ev.kind, ev.is_process))
    finally:
        events.sock.close()
    return seen


@pytest.mark.skipif(os.geteuid() != 0, reason="the proc connector needs root")
def test_proc_connector_sees_a_real_fork_exec_thread_and_exit() -> None:
    seen = connector_events(filtered=False)
    assert {("fork", True), ("exec", True), ("fork", False), ("exit", True)} <= seen


@pytest.mark.skipif(os.geteuid() != 0, reason="the proc connector needs root")
def test_the_kernel_filter_keeps_only_process_fork_exec_comm() -> None:
    assert connector_events(filtered=True) == {("fork", True), ("exec", True)}


# -- a real daemon ------------------------------------------------------------------------


def marked(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line holds `marker`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        cmdline = read_cmdline(FS, pid)
        s = read_proc_stat(FS, pid)
        if cmdline and marker in cmdline and s is not None and s.state not in ("Z", "X"):
            found.append(pid)
    return found


def settled_marked(marker: str) -> set[int]:
    """`marked` once two reads 0.2 s apart agree: the trees' intermediate forks (the
    parent an orphan leaves behind, a child not yet exec'd) have come and gone."""
    last: list[set[int]] = [set(marked(marker))]

    def same() -> set[int] | None:
        time.sleep(0.2)
        now = set(marked(marker))
        settled = now == last[0]
        last[0] = now
        return now if settled else None

    found: set[int] = poll(same, timeout_s=30, interval_s=0, what="the marked processes settled")
    return found


def zombie_children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        s = read_proc_stat(FS, int(name)) if name.isdigit() else None
        if s is not None and s.ppid == pid and s.state == "Z":
            out.append(s.pid)
    return out


def tree_config(tmp_path: Path, marker: str, cgroup: str) -> Path:
    script = tmp_path / "tree_child.py"
    script.write_text(TREE_CHILD)
    ready = tmp_path / "engine.ready"
    doc: dict[str, Any] = {
        "cpu_ranks": 1,
        "cgroup": cgroup,
        "stop_timeout_s": 1,
        "engine": {"command": ["python", str(script), marker, "engine", str(ready)]},
        "ready": {"file": str(ready), "timeout_s": 30},
        "workers": {"command": ["python", str(script), marker, "rank{rank}"]},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
    }
    path = tmp_path / "tree.toml"
    path.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 0.2\n")
    return path


def whole_trees(daemon: DaemonProcess) -> dict[str, Any] | None:
    """/placement once both trees show their setsid grandchild and their orphan."""
    doc = daemon.running()
    if doc is None:
        return None
    for entry in (doc["engine"], doc["ranks"][0]):
        lines = " | ".join(c["cmdline"] for c in entry["children"])
        if "-setsid" not in lines or "-orphan" not in lines:
            return None
    return doc


def instance_dirs(suffix: str) -> list[Path]:
    return [p for p in Path("/sys/fs/cgroup").glob(f"*/**/placement-supervisor-{suffix}")]


@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_clean_stop_ends_every_tree_and_removes_its_cgroups(tmp_path: Path, cgroup: str) -> None:
    marker = f"tree-{uuid.uuid4().hex}"
    suffix = f"trees-{cgroup}-{os.getpid()}"
    env = daemon_env(**{INSTANCE_ENV: suffix})
    with DaemonProcess(tree_config(tmp_path, marker, cgroup), tmp_path / "d.log", env=env) as d:
        try:
            doc = poll(lambda: whole_trees(d), timeout_s=60, what="trees with setsid + orphan")
        except AssertionError:
            # Seen once (cgroup "off", a parallel run): what the trees held, and why.
            trees = [(e["rank"], e["children"]) for e in (d.placement() or {}).get("ranks", [])]
            pytest.fail(f"no whole trees: {trees}; marked {marked(marker)}; {d.tail(6000)}")
        engine_children = doc["engine"]["children"]
        orphan = next(c for c in engine_children if "engine-orphan" in c["cmdline"])
        assert orphan["ppid"] == d.pid  # reparented to the daemon, still the engine's
        # The brief orphan may end between the two reads (1.5 s; a loaded host).
        lasting = {c["pid"] for c in engine_children if "-brief" not in c["cmdline"]}
        assert set(marked(marker)) >= lasting
        if cgroup == "auto":
            assert instance_dirs(suffix)

        def brief_orphans_reaped() -> bool:
            live = [p for p in marked(marker) if "-brief" in (read_cmdline(FS, p) or "")]
            return not live and zombie_children(d.pid) == []

        poll(brief_orphans_reaped, timeout_s=20, what=f"reaped: {zombie_children(d.pid)}")
        code = d.stop(timeout_s=30)
    assert code == 0, d.tail()
    assert marked(marker) == [], d.tail()
    assert instance_dirs(suffix) == [], d.tail()
    assert "EBUSY" not in d.log.read_text()


@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_sigkill_of_the_daemon_leaves_no_process_and_no_cgroup(tmp_path: Path, cgroup: str) -> None:
    """The guardian ends the cgroups' processes (auto), or the processes the
    daemon told it about, checked by start time (off)."""
    marker = f"tree-{uuid.uuid4().hex}"
    suffix = f"trees-kill-{cgroup}-{os.getpid()}"
    env = daemon_env(**{INSTANCE_ENV: suffix})
    with DaemonProcess(tree_config(tmp_path, marker, cgroup), tmp_path / "d.log", env=env) as d:
        poll(lambda: whole_trees(d), timeout_s=60, what="trees with setsid + orphan")
        assert len(marked(marker)) >= 6  # engine, worker, 2 x (setsid, orphan), at least
        d.proc.kill()
        d.proc.wait()
        poll(lambda: marked(marker) == [], timeout_s=20, what=f"no survivors: {marked(marker)}")
        poll(lambda: instance_dirs(suffix) == [], timeout_s=20, what="cgroups removed")


@pytest.mark.skipif(not (CPUSET / "cpuset.cpus").exists(), reason="needs cgroup v1 cpuset")
def test_a_new_daemon_ends_what_an_earlier_instance_left(tmp_path: Path) -> None:
    marker = f"left-{uuid.uuid4().hex}"
    suffix = f"trees-left-{os.getpid()}"
    # cgroup v1: the per-process cgroups are memory cgroups (no per-rank cpusets).
    memory = own_memory_cgroup()
    assert memory is not None
    inst = memory / f"placement-supervisor-{suffix}"
    left = inst / "rank0"
    left.mkdir(parents=True)
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", marker])
    try:
        (left / "cgroup.procs").write_text(str(stray.pid))
        env = daemon_env(**{INSTANCE_ENV: suffix})
        config = tree_config(tmp_path, f"tree-{uuid.uuid4().hex}", "auto")
        with DaemonProcess(config, tmp_path / "d.log", env=env) as d:
            poll(d.running, timeout_s=60)
            assert stray.wait(timeout=10) == -9
            log = d.tail(20000)
            assert f"leftover processes cgroup={left}" in log
            assert f"pids={stray.pid}" in log
        assert not inst.exists()
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
        for d in (left, inst):
            if d.exists():
                d.rmdir()


def test_no_sweep_while_a_daemon_of_the_instance_runs(tmp_path: Path) -> None:
    """A second start of the same config must not take the running one's
    processes for leftovers: its guardian, alive under its daemon, says so."""
    marker = f"tree-{uuid.uuid4().hex}"
    suffix = f"trees-live-{os.getpid()}"
    env = daemon_env(**{INSTANCE_ENV: suffix})
    with DaemonProcess(tree_config(tmp_path, marker, "auto"), tmp_path / "d.log", env=env) as d:
        poll(lambda: whole_trees(d), timeout_s=60)
        before = settled_marked(marker)
        setup = detect_cgroup_setup(FS)
        assert setup is not None
        manager = CgroupManager(FS, setup, suffix=suffix)
        inst = FS.path(manager.instance_dirs[0])
        guardian = live_guardian(FS, inst)
        assert guardian is not None and guardian[1] == d.pid
        assert sweep_leftovers(manager) == []
        assert set(marked(marker)) == before
    assert marked(marker) == []
    assert live_guardian(FS, inst) is None
