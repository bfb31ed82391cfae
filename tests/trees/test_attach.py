"""Attach mode (docs/attach.md): a real daemon places an engine it did not start.

The engine is a small torchrun-like launcher started by the test (a plain
`sh -c`, or a shell that joins a transient `run-*.scope`-like cgroup v1 cpuset
first, as systemd-run would), never by the supervisor: it narrows its own CPU
affinity to CPU 0 and starts two workers with LOCAL_RANK=0/1, each with two
extra threads. The daemon finds it (by command line, cgroup path or unit
name), adopts the workers onto their ranks' CPUs, finds the next engine after
the test kills the first, and on its stop leaves every process running with
the affinity it had when found. The config's errors and the finder's pure
parts are tested on their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import Config, parse_config
from supervisor.config_sections import AttachTarget
from supervisor.cpulist import format_cpulist, parse_cpulist
from supervisor.daemon.reload import restart_reasons
from supervisor.daemon.root import prepare
from supervisor.errors import ConfigError, TopologyError
from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from supervisor.listen import parse_listen
from supervisor.plan.placement import Slot
from supervisor.plan.replan import AllowedSet
from supervisor.procfs.identity import ProcessId, ThreadId
from supervisor.procfs.stat import ProcStat
from supervisor.serve.status import http_request
from supervisor.topology.cgroup import CpusetCache
from supervisor.topology.discover import reread_cpus
from supervisor.trees.find_engine import cgroup_paths, dying, names, pick_root
from supervisor.watch.adoption import Adoptee, decide_detach
from supervisor.watch.drift import process_findings
from supervisor.watch.observe import observe_process
from supervisor.watch.scan import read_allowed
from tests.support.cgroup_v1 import v1_available, v1_cpuset
from tests.support.children import thread_cpus
from tests.support.daemon_support import INSTANCE_ENV, DaemonProcess, daemon_env, to_toml
from tests.support.poll import poll

# -- the config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (
            {"command": ["vllm", "serve"], "attach": {"unit": "vllm.service"}},
            "engine.attach: give either command or attach, not both",
        ),
        (
            {"attach": {"unti": "vllm.service"}},
            "engine.attach.unti: unknown attach key; give one of unit, cgroup, match",
        ),
        ({"attach": {}}, "engine.attach: give exactly one of unit, cgroup, match"),
        (
            {"attach": {"unit": "a.service", "match": "vllm"}},
            "engine.attach: give exactly one of unit, cgroup, match",
        ),
        (
            {"attach": {"cgroup": "system.slice/x.service"}},
            "engine.attach.cgroup: a cgroup path starts with / (as in /proc/PID/cgroup), "
            "got 'system.slice/x.service'",
        ),
        (
            {"attach": {"unit": "/system.slice/x.service"}},
            "engine.attach.unit: a unit name, not a path, got '/system.slice/x.service'",
        ),
        ({"attach": {"match": " "}}, "engine.attach.match: must be a non-empty string"),
        ({"attach": "vllm.service"}, "engine.attach: expected a table"),
        (
            {"attach": {"cgroup": "/x", "cpus": "0-3,a"}},
            "engine.attach.cpus: not a CPU list like \"0-7,16\": bad item 'a' in list '0-3,a'",
        ),
        (
            {"attach": {"cgroup": "/x", "cpus": " "}},
            "engine.attach.cpus: must name at least one CPU",
        ),
        ({"attach": {"cgroup": "/x", "cpus": 3}}, "engine.attach.cpus: expected a string"),
    ],
)
def test_attach_config_errors_name_the_field(engine: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"engine": {"kind": "vllm", **engine}}, "c.toml")
    assert str(info.value).startswith(f"c.toml: {message}")
    assert "\n" not in str(info.value)


def test_attach_config_workers_and_cgroups() -> None:
    cfg = parse_config({"engine": {"attach": {"match": "vllm serve /models/x"}}}, "c.toml")
    assert cfg.engine is not None and cfg.engine.attach == AttachTarget(
        "match", "vllm serve /models/x"
    )
    assert cfg.engine.kind == "vllm"  # "auto" reads the match's words
    assert cfg.engine.command == ()
    assert cfg.workers.spawned_by == "engine"  # implied
    assert cfg.cgroup == "off"  # no cgroups of ours for processes we did not start
    with pytest.raises(ConfigError, match=r"c\.toml: workers: an attached engine spawns"):
        parse_config(
            {"engine": {"attach": {"unit": "x.service"}}, "workers": {"command": ["w"]}},
            "c.toml",
        )
    with pytest.raises(ConfigError, match=r"c\.toml: workers\.rank_from: is required"):
        parse_config({"engine": {"attach": {"unit": "x.service"}}}, "c.toml")
    with pytest.raises(ConfigError, match=r"c\.toml: ready: not used with engine\.attach"):
        parse_config(
            {"engine": {"attach": {"unit": "x.service"}, "kind": "vllm"}, "ready": {"tcp": "h:1"}},
            "c.toml",
        )


def test_a_reload_that_changes_the_attach_target_needs_a_restart() -> None:
    by_unit = parse_config({"engine": {"attach": {"unit": "a.service"}, "kind": "vllm"}})
    by_match = parse_config({"engine": {"attach": {"match": "vllm serve"}}})
    assert restart_reasons(by_unit, by_unit) == ()
    assert "engine.attach (the engine is found or spawned by it)" in restart_reasons(
        by_unit, by_match
    )


# -- the finder's pure parts ------------------------------------------------------------------


def stat(pid: int, ppid: int, start: int) -> ProcStat:
    return ProcStat(pid, "x", "S", ppid, pid, 0, 0, start)


def test_names_and_pick_root() -> None:
    v1 = cgroup_paths("4:memory:/system.slice/vllm.service\n3:cpuset:/\n0::/\n")
    v2 = cgroup_paths("0::/system.slice/vllm.service/payload\n")
    unit = AttachTarget("unit", "vllm.service")
    assert names(unit, v1, "vllm serve") == "/system.slice/vllm.service"
    assert names(unit, v2, "vllm serve") == "/system.slice/vllm.service"
    assert names(unit, cgroup_paths("0::/system.slice/vllm.service2\n"), "x") is None
    cgroup = AttachTarget("cgroup", "/system.slice/vllm.service/")
    assert names(cgroup, v2, "") == "/system.slice/vllm.service"
    assert names(AttachTarget("cgroup", "/system.slice/vll"), v2, "") is None
    match = AttachTarget("match", "vllm serve")
    assert names(match, [], "python -m vllm serve x") == "python -m vllm serve x"
    assert names(match, [], "vllm") is None
    stats = {1: stat(1, 0, 1), 10: stat(10, 1, 50), 11: stat(11, 10, 60), 20: stat(20, 1, 40)}
    assert pick_root({10: "", 11: ""}, stats) == 10  # 11's parent is named
    assert pick_root({10: "", 11: "", 20: ""}, stats) == 20  # two roots: the oldest
    assert pick_root({}, stats) is None
    assert dying("Name:\tpython\nShdPnd:\t0000000000000100\nSigPnd:\t0000000000000000\n")
    assert not dying("ShdPnd:\t0000000000004000\nSigPnd:\t0000000000000000\n")  # a TERM


def test_decide_detach_puts_each_thread_back_and_nothing_else() -> None:
    adoptees = [
        Adoptee(ProcessId(10, 100), (ThreadId(10, 100), ThreadId(11, 101))),
        Adoptee(ProcessId(20, 200), (ThreadId(20, 200),)),
    ]
    d = decide_detach("engine", adoptees, {10: frozenset({3, 1}), 20: [0]})
    assert [(b.tid, b.cpus, b.id, b.pid) for b in d.binds] == [
        (10, (1, 3), ThreadId(10, 100), 10),
        (11, (1, 3), ThreadId(11, 101), 10),
        (20, (0,), ThreadId(20, 200), 20),
    ]
    assert d.pid == 10 and d.moves == () and d.joins == ()
    assert decide_detach(1, adoptees, {20: [0]}).binds[0].tid == 20  # 10 left alone


# -- a real engine, a real daemon ---------------------------------------------------------------

ENGINE = r"""
import os, subprocess, sys, time
marker, ready, worker = sys.argv[1:4]
# The operator's own pinning (its cgroup's first CPU): what the detach puts back.
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
procs = [
    subprocess.Popen([sys.executable, worker, marker], env=dict(os.environ, LOCAL_RANK=str(r)))
    for r in range(2)
]
open(ready, "w").close()
while all(p.poll() is None for p in procs):
    time.sleep(0.1)
"""

WORKER = r"""
import threading, time
for i in range(2):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
time.sleep(3600)
"""


class Engine:
    """The launcher under `sh -c` (optionally joining `cgroup` first), in a process
    group of its own that `kill` ends whole."""

    def __init__(self, tmp_path: Path, marker: str, cgroup: Path | None = None) -> None:
        engine, worker = tmp_path / "engine.py", tmp_path / "worker.py"
        engine.write_text(ENGINE)
        worker.write_text(WORKER)
        self.ready = tmp_path / f"ready-{uuid.uuid4().hex}"
        run = f"{sys.executable} {engine} {marker} {self.ready} {worker}"
        join = "" if cgroup is None else f"echo $$ > {cgroup}/cgroup.procs && "
        # Not exec'd: the shell stays the tree's root, as a login shell or script would.
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", f"{join}{run}; true"], start_new_session=True
        )
        poll(self.ready.exists, timeout_s=30, what="the engine's workers started")

    def tree(self) -> dict[int, str]:
        """pid -> cmdline of the shell and everything below it."""
        out: dict[int, str] = {}
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            out[pid] = raw.replace(b"\0", b" ").decode()
            todo += [int(c) for c in children]
        return out

    def affinities(self) -> dict[int, set[str]]:
        """pid -> the Cpus_allowed_list of its threads."""
        return {pid: set(thread_cpus(pid).values()) for pid in self.tree()}

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@contextlib.contextmanager
def engine(tmp_path: Path, marker: str, cgroup: Path | None = None) -> Iterator[Engine]:
    e = Engine(tmp_path, marker, cgroup)
    try:
        yield e
    finally:
        e.kill()


def attach_config(tmp_path: Path, attach: dict[str, str]) -> Path:
    doc: dict[str, Any] = {
        "cpu_ranks": 2,
        "stop_timeout_s": 2,
        "engine": {"attach": attach},
        "workers": {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]},
        "placement": {"rank_roles": {}, "on_shortage": "share"},
    }
    path = tmp_path / "attach.toml"
    path.write_text(to_toml(doc) + "[drift]\ncheck_interval_s = 0.2\n")
    return path


def attached(d: DaemonProcess, engine_pid: int) -> dict[str, Any] | None:
    """/placement once the engine is `engine_pid` and each rank runs adopted, bound as planned."""
    doc = d.placement()
    if doc is None or doc["engine"]["pid"] != engine_pid or doc["engine"]["state"] != "running":
        return None
    for r in doc["ranks"]:
        if r["state"] != "running" or not r["adopted"]:
            return None
        if set(thread_cpus(r["pid"]).values()) != {format_cpulist(r["cpus"])}:
            return None
    return doc


def check_attached_and_detached(  # noqa: PLR0917 - one helper of these tests
    d: DaemonProcess,
    e: Engine,
    root: int,
    before: dict[int, set[str]],
    cpus: str = "0-1",
    drift: bool = False,
) -> None:
    """Placed, then stopped: every process still runs with the affinity it had when
    found (`before`, read before the daemon started)."""
    assert before[e.proc.pid] == {cpus} and len(before) == 4  # sh, engine, two workers
    doc = poll(lambda: attached(d, root), timeout_s=60, what="engine attached, ranks placed")
    workers = {r["rank"]: r["pid"] for r in doc["ranks"]}
    assert set(workers.values()) <= set(e.tree())  # the engine's own workers
    assert len(d.events("attached")) == 1
    if drift:
        # Drift is checked as for any adopted worker: a thread moved away goes back.
        rank = doc["ranks"][1]
        tid = max(thread_cpus(rank["pid"]))
        os.sched_setaffinity(tid, {0, 1})
        want = format_cpulist(rank["cpus"])
        poll(lambda: thread_cpus(rank["pid"]).get(tid) == want, timeout_s=30, what="re-bound")
    code = d.stop(timeout_s=30)
    assert code == 0, d.tail()
    assert "detached" in d.tail(20000)
    assert e.proc.poll() is None, "the engine must outlive the supervisor"
    assert e.affinities() == before, d.tail()


@pytest.mark.skipif(os.geteuid() != 0, reason="binds other processes' threads: needs root")
def test_an_engine_started_by_a_shell_is_attached_by_match_and_left_running(
    tmp_path: Path,
) -> None:
    marker = f"attach-{uuid.uuid4().hex}"
    env = daemon_env(**{INSTANCE_ENV: f"attach-match-{os.getpid()}"})
    with engine(tmp_path, marker) as e:
        config = attach_config(tmp_path, {"match": marker})
        before = e.affinities()
        with DaemonProcess(config, tmp_path / "d.log", env=env) as d:
            # The shell's command line holds the marker too: it is the root.
            check_attached_and_detached(d, e, e.proc.pid, before, drift=True)


@pytest.mark.skipif(v1_available() is not None, reason=str(v1_available()))
@pytest.mark.parametrize(("how", "cpus"), [("cgroup", "1"), ("unit", "0-1")])
def test_an_engine_in_a_transient_scope_is_attached_by_its_cgroup(
    tmp_path: Path, how: str, cpus: str
) -> None:
    """The scope's cpuset is the plan's bound: with CPU 1 alone, every slot is CPU 1."""
    name = f"run-ps{os.getpid()}-{uuid.uuid4().hex[:8]}.scope"
    env = daemon_env(**{INSTANCE_ENV: f"attach-{how}-{os.getpid()}"})
    marker = f"attach-{uuid.uuid4().hex}"
    with v1_cpuset(name, cpus) as scope, engine(tmp_path, marker, scope) as e:
        target = {"cgroup": f"/{name}"} if how == "cgroup" else {"unit": name}
        before = e.affinities()
        with DaemonProcess(attach_config(tmp_path, target), tmp_path / "d.log", env=env) as d:
            doc = poll(lambda: attached(d, e.proc.pid), timeout_s=60, what="attached")
            slots = [doc["engine"], *doc["ranks"]]
            assert {c for s in slots for c in s["cpus"]} <= parse_cpulist(cpus), doc
            assert f"engine cpuset cgroup=/{name} engine_cpus={cpus}" in d.tail(20000)
            # The shell joined, then ran the engine: it is the root of the scope.
            check_attached_and_detached(d, e, e.proc.pid, before, cpus)


UNIFIED = Path("/sys/fs/cgroup/unified")


@contextlib.contextmanager
def v2_scope(name: str) -> Iterator[Path]:
    """A cgroup2 directory under the hybrid host's unified hierarchy (no controllers:
    membership alone, as systemd's name=systemd / unified tree holds a unit's
    processes); its processes moved back to the root and the directory removed after."""
    scope = UNIFIED / name
    scope.mkdir()
    try:
        yield scope
    finally:
        for pid in (scope / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (UNIFIED / "cgroup.procs").write_text(pid)
        poll(lambda: not (scope / "cgroup.procs").read_text().split(), timeout_s=10)
        scope.rmdir()


@pytest.mark.skipif(
    os.geteuid() != 0 or not (UNIFIED / "cgroup.procs").exists(),
    reason="needs root and a cgroup2 hierarchy at /sys/fs/cgroup/unified",
)
def test_an_engine_in_a_cgroup2_scope_is_found_by_its_unit(tmp_path: Path) -> None:
    """Found by its "0::/run-*.scope" line of /proc/PID/cgroup (cgroup v2)."""
    name = f"run-ps{os.getpid()}-{uuid.uuid4().hex[:8]}.scope"
    env = daemon_env(**{INSTANCE_ENV: f"attach-v2-{os.getpid()}"})
    marker = f"attach-{uuid.uuid4().hex}"
    with v2_scope(name) as scope, engine(tmp_path, marker, scope) as e:
        assert f"0::/{name}" in Path(f"/proc/{e.proc.pid}/cgroup").read_text()
        before = e.affinities()
        config = attach_config(tmp_path, {"unit": name})
        with DaemonProcess(config, tmp_path / "d.log", env=env) as d:
            check_attached_and_detached(d, e, e.proc.pid, before)


@pytest.mark.skipif(os.geteuid() != 0, reason="binds other processes' threads: needs root")
def test_the_daemon_waits_for_the_engine_and_finds_it_again_after_a_restart(
    tmp_path: Path,
) -> None:
    marker = f"attach-{uuid.uuid4().hex}"
    env = daemon_env(**{INSTANCE_ENV: f"attach-again-{os.getpid()}"})
    config = attach_config(tmp_path, {"match": marker})
    sock = tmp_path / "api.sock"
    config.write_text(
        config.read_text().replace("[drift]", f'[api]\nunix_socket = "{sock}"\n\n[drift]', 1)
    )
    with DaemonProcess(config, tmp_path / "d.log", env=env) as d:
        poll(
            lambda: (d.placement() or {"engine": {}})["engine"].get("state") == "waiting",
            timeout_s=30,
            what="the engine waited for",
        )
        poll(lambda: "engine waiting" in d.tail(), timeout_s=10, what="the waiting line")
        with engine(tmp_path, marker) as first:
            doc = poll(lambda: attached(d, first.proc.pid), timeout_s=60, what="first attached")
            old = {r["pid"] for r in doc["ranks"]}
            # A restart request would signal a process we did not start: refused.
            code, _, body = http_request(parse_listen(f"unix:{sock}"), "POST", "/ranks/0/restart")
            assert code == 409, body
            assert "never restarts a process it did not start" in body.decode()
            assert first.proc.poll() is None
        # The first engine is gone (the test killed it): the next one is found and placed.
        with engine(tmp_path, marker) as second:
            doc = poll(lambda: attached(d, second.proc.pid), timeout_s=60, what="second attached")
            assert not {r["pid"] for r in doc["ranks"]} & old
            assert len(d.events("attached")) == 2, [e["message"] for e in d.events("attached")]
            assert d.stop(timeout_s=30) == 0, d.tail()
            assert second.proc.poll() is None


@pytest.mark.skipif(v1_available() is not None, reason=str(v1_available()))
def test_an_engine_found_later_in_a_narrower_cpuset_is_warned_about(tmp_path: Path) -> None:
    """Planned before the engine ran (on the supervisor's CPUs 0-1): the engine's
    cgroup allows CPU 1 alone, and the attach says which planned CPUs lie outside."""
    name = f"run-ps{os.getpid()}-{uuid.uuid4().hex[:8]}.scope"
    marker = f"attach-{uuid.uuid4().hex}"
    env = daemon_env(**{INSTANCE_ENV: f"attach-later-{os.getpid()}"})
    config = attach_config(tmp_path, {"match": marker})
    with v1_cpuset(name, "1") as scope, DaemonProcess(config, tmp_path / "d.log", env=env) as d:
        poll(lambda: "engine waiting" in d.tail(), timeout_s=30, what="the engine waited for")
        with engine(tmp_path, marker, scope) as e:
            found = poll(
                lambda: [
                    x for x in d.events("error") if "outside the engine's cgroup" in x["message"]
                ],
                timeout_s=60,
                what="the warning",
            )
            assert found[0]["message"].startswith(
                f"engine: the plan uses CPUs 0 outside the engine's cgroup /{name}"
            ), found
            assert d.stop(timeout_s=30) == 0, d.tail()
            assert e.proc.poll() is None
            assert all(v == {"1"} for v in e.affinities().values()), e.affinities()


@pytest.mark.skipif(v1_available() is not None, reason=str(v1_available()))
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs CPUs 0 and 1")
@pytest.mark.parametrize("how", ["cgroup", "match"])
def test_a_supervisor_on_other_cpus_than_the_engine_plans_on_the_engines(
    tmp_path: Path, how: str
) -> None:
    """Defect A: the engine's cgroup has CPU 1 alone (a Guaranteed pod's exclusive
    CPU) and the supervisor runs on CPU 0 (the shared pool, a unit's CPUAffinity=).
    The plan is the engine's CPU 1 (planned on CPU 0, every bind was refused with
    EINVAL), and the supervisor's own affinity is left at CPU 0."""
    name = f"run-ps{os.getpid()}-{uuid.uuid4().hex[:8]}.scope"
    env = daemon_env(**{INSTANCE_ENV: f"attach-other-{how}-{os.getpid()}"})
    marker = f"attach-{uuid.uuid4().hex}"
    with v1_cpuset(name, "1") as scope, engine(tmp_path, marker, scope) as e:
        target = {"cgroup": f"/{name}"} if how == "cgroup" else {"match": marker}
        before = e.affinities()
        config = attach_config(tmp_path, target)
        with DaemonProcess(config, tmp_path / "d.log", env=env, prefix=["taskset", "-c", "0"]) as d:
            doc = poll(lambda: attached(d, e.proc.pid), timeout_s=60, what="placed on CPU 1")
            assert [doc["engine"]["cpus"], *(r["cpus"] for r in doc["ranks"])] == [[1]] * 3, doc
            assert [r["mems"] for r in doc["ranks"]] == [[0], [0]], doc
            assert os.sched_getaffinity(d.proc.pid) == {0}
            check_attached_and_detached(d, e, e.proc.pid, before, "1")


@pytest.mark.skipif(os.geteuid() != 0, reason="binds other processes' threads: needs root")
def test_workers_orphaned_by_their_engine_get_their_affinity_back(tmp_path: Path) -> None:
    """The engine dies, its adopted workers run on (reparented away from its tree):
    the stop still puts their affinity back, and signals none of them."""
    marker = f"attach-{uuid.uuid4().hex}"
    env = daemon_env(**{INSTANCE_ENV: f"attach-orphans-{os.getpid()}"})
    with engine(tmp_path, marker) as e:
        before = e.affinities()
        with DaemonProcess(
            attach_config(tmp_path, {"match": marker}), tmp_path / "d.log", env=env
        ) as d:
            doc = poll(lambda: attached(d, e.proc.pid), timeout_s=60, what="attached")
            workers = [r["pid"] for r in doc["ranks"]]
            launcher = next(p for p, c in e.tree().items() if "engine.py" in c and p != e.proc.pid)
            os.kill(launcher, signal.SIGKILL)
            e.proc.wait(timeout=10)  # the shell ends with it
            poll(
                lambda: (d.placement() or {"engine": {}})["engine"].get("state") == "waiting",
                timeout_s=30,
                what="the engine gone",
            )
            assert d.stop(timeout_s=30) == 0, d.tail()
        for pid in workers:
            assert set(thread_cpus(pid).values()) == before[pid], (pid, d.tail())


# -- planning within the engine's cgroup, on a fixture host -----------------------------------


def engine_host(tmp_path: Path, engine_mems: str) -> HostFS:
    """Two nodes of 4 CPUs (0-3, 4-7), a GPU on each (GPU 0 on node 1, GPU 1 on
    node 0). The supervisor's own affinity is CPUs 0-3 (a node agent's child in
    the shared pool); the engine's container cgroup /eng has the exclusive CPUs
    4-7 and the memory nodes `engine_mems`."""
    root = (
        FakeHost(tmp_path)
        .cpus(2, 4, 1)
        .allowed("0-3", "0-1")
        .cgroup_v1("/", "0-7", "0-1")
        .nvidia_gpu("0000:41:00.0", 1)
        .nvidia_gpu("0000:01:00.0", 0)
        .raw("sys/fs/cgroup/cpuset/eng/cpuset.cpus", "4-7\n")
        .raw("sys/fs/cgroup/cpuset/eng/cpuset.effective_cpus", "4-7\n")
        .raw("sys/fs/cgroup/cpuset/eng/cpuset.effective_mems", f"{engine_mems}\n")
        .build()
    )
    return HostFS(str(root))


def engine_config(attach: dict[str, str]) -> Config:
    return parse_config(
        {
            "engine": {"attach": attach, "kind": "vllm"},
            "placement": {"rank_roles": {}, "on_shortage": "share"},
        },
        "c.toml",
    )


def test_attach_plans_within_the_engine_cgroup_not_the_supervisors_affinity(
    tmp_path: Path,
) -> None:
    """Defect A: the plan took the supervisor's own CPUs (0-3), which the kernel
    refuses for every thread of an engine confined to 4-7."""
    fs = engine_host(tmp_path, "0-1")
    topology, placement = prepare(engine_config({"cgroup": "/eng"}), {}, fs)
    assert topology.allowed.cpus == {4, 5, 6, 7}, topology.allowed
    assert topology.allowed.of_engine and topology.allowed.cgroup_path == "/eng"
    used = {c for r in placement.ranks for c in r.slot.cpus}
    assert used and used <= {4, 5, 6, 7}, placement.ranks
    # Every re-read after a cpuset change reads the engine's cgroup again.
    assert reread_cpus(fs, topology).allowed == topology.allowed
    assert read_allowed(fs, [0, 1], CpusetCache(), topology.allowed.scope) == AllowedSet(
        frozenset({4, 5, 6, 7}), frozenset({0, 1})
    )


def test_attach_cpus_narrow_the_plan_within_the_engine_cgroup(tmp_path: Path) -> None:
    fs = engine_host(tmp_path, "0-1")
    topology, placement = prepare(engine_config({"cgroup": "/eng", "cpus": "6-7,9"}), {}, fs)
    assert topology.allowed.cpus == {6, 7}
    assert {c for r in placement.ranks for c in r.slot.cpus} <= {6, 7}


def test_attach_cpus_outside_the_engine_cgroup_are_refused_naming_both(tmp_path: Path) -> None:
    fs = engine_host(tmp_path, "0-1")
    with pytest.raises(TopologyError) as info:
        prepare(engine_config({"cgroup": "/eng", "cpus": "0-3"}), {}, fs)
    assert "the engine's cgroup /eng has CPUs 4-7" in str(info.value)
    assert "engine.attach.cpus 0-3" in str(info.value)


def test_an_unknown_engine_cpuset_plans_within_the_supervisors_own(tmp_path: Path) -> None:
    """No engine runs yet for a `match`: its cgroup is unknown, the supervisor's
    own CPUs (0-3) are planned, narrowed by attach.cpus."""
    fs = engine_host(tmp_path, "0-1")
    target = {"match": f"vllm serve nothing-{uuid.uuid4().hex}", "cpus": "1-7"}
    topology, _ = prepare(engine_config(target), {}, fs)
    assert topology.allowed.cpus == {1, 2, 3}
    assert not topology.allowed.of_engine


def test_a_rank_node_outside_the_engine_mems_leaves_its_memory_alone(tmp_path: Path) -> None:
    """Defect B: as root, migrate_pages(2) checks the nodes against the caller's
    mems only; the engine's container has node 1 alone, so GPU 1's rank (node 0)
    gets no node, and says why, rather than node 0 or a nearer one."""
    fs = engine_host(tmp_path, "1")
    topology, placement = prepare(engine_config({"cgroup": "/eng"}), {}, fs)
    assert topology.allowed.mems == {1}
    by_node = {r.device.numa_node: r.slot.mems for r in placement.ranks}
    assert by_node == {1: (1,), 0: ()}, placement.ranks
    assert any(
        "memory node 0 is outside the engine's cgroup cpuset.mems 1" in w
        and "left where it is" in w
        for w in placement.warnings
    ), placement.warnings


def test_no_memory_node_means_no_locality_drift_and_no_page_move() -> None:
    """The check loop, for a rank without a node: its pages (this process's own,
    read from its numa_maps) are not judged remote, so nothing is moved."""
    fs = HostFS("/")
    slot = Slot((0,), ())
    obs = observe_process(fs, os.getpid(), slot, "worker", numa_maps=True)
    assert obs.memory_bytes_by_node, "numa_maps read nothing"
    assert obs.local_memory_ratio is None
    assert process_findings(slot, obs, threshold=0.9) == ()
