"""The check loop covers every process of a supervised process's tree (docs/contracts.md §6, 3.7).

Pure rows for where a role's CPUs come from (`role_kinds`, `RoleMatcher` with
several kinds, `with_engine_roles`), then a real daemon over a real engine:
a front process that starts a `multiprocessing` spawn child (vLLM's
EngineCore: a member of the engine's tree, not adopted) and one worker per
rank that the daemon adopts by `env:LOCAL_RANK` (SGLang's schedulers). Each
runs a thread named `so_compiler-0`, as the start-up hook names pool
threads, and `[threads.so_compiler] process = "engine"`.

This box has 2 CPUs: the engine's slot is 0-1 with main 0 and so_compiler 1,
rank 0 has CPU 0 and rank 1 CPU 1. The spawn child's compiler thread belongs
on CPU 1; a test moves it to CPU 0 and reads /proc (enforce) or /placement
(observe). An adopted worker's compiler thread belongs on the engine's
so_compiler CPU only where that lies in its cpuset: with cgroups off, rank
0's goes to CPU 1; in rank 0's cgroup (CPU 0) it stays on rank 0's main.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from supervisor.bind.cgroup import detect_cgroup_setup
from supervisor.hostfs import HostFS
from supervisor.plan.keys import ThreadRole
from supervisor.plan.placement import Slot
from supervisor.plan.threads import RoleMatcher, role_kinds, with_engine_roles
from tests.support.children import thread_cpus
from tests.support.daemon_support import (
    DaemonProcess,
    daemon_env,
    to_toml,
)
from tests.support.poll import poll

ROLES = (
    ThreadRole("comm", "workers", "comm*"),
    ThreadRole("so_compiler", "engine", "so_compiler-*"),
    ThreadRole("both", "engine", "both*"),
    ThreadRole("both", "workers", "both*"),
)
ENGINE = Slot((4, 5, 6, 7), (0,), {"main": (4, 5), "so_compiler": (6, 7)})
RANK = Slot((0, 1, 2), (0,), {"main": (0, 1), "comm": (2,)})


def test_role_kinds_per_supervised_process() -> None:
    assert role_kinds("engine", adopted=False) == ("engine",)
    assert role_kinds(0, adopted=False) == ("workers",)
    assert role_kinds(3, adopted=True) == ("workers", "engine")


@pytest.mark.parametrize(
    ("kinds", "name", "role"),
    [
        (("engine",), "so_compiler-0", "so_compiler"),
        (("engine",), "comm0", "main"),
        (("workers",), "so_compiler-0", "main"),
        (("workers",), "comm0", "comm"),
        (("workers", "engine"), "so_compiler-0", "so_compiler"),
        (("workers", "engine"), "comm0", "comm"),
    ],
)
def test_an_adopted_worker_matches_both_kinds(kinds: Any, name: str, role: str) -> None:
    assert RoleMatcher(kinds, ROLES).role(name) == role


@pytest.mark.parametrize(
    ("cpuset", "roles"),
    [
        # No cgroup of its own: the engine's so_compiler CPUs are usable.
        (tuple(range(8)), {"main": (0, 1), "comm": (2,), "so_compiler": (6, 7)}),
        # In the rank's cgroup: they are not; role_cpus falls back to main.
        ((0, 1, 2), {"main": (0, 1), "comm": (2,)}),
        # Part of them only: still not (a partial bind would fail).
        ((0, 1, 2, 6), {"main": (0, 1), "comm": (2,)}),
    ],
)
def test_engine_roles_in_a_worker_only_inside_its_cpuset(
    cpuset: tuple[int, ...], roles: dict[str, tuple[int, ...]]
) -> None:
    slot = with_engine_roles(RANK, ENGINE, ROLES, cpuset)
    assert dict(slot.roles) == roles
    assert (slot.cpus, slot.mems) == (RANK.cpus, RANK.mems)
    # "both" is a workers role too: the rank's meaning (main) wins.
    assert slot.role_cpus("both") == (0, 1)
    assert with_engine_roles(RANK, None, ROLES, cpuset) is RANK


def test_a_rank_that_plans_the_role_keeps_its_own_cpus() -> None:
    rank = Slot((0, 1, 2), (0,), {"main": (0, 1), "so_compiler": (2,)})
    assert with_engine_roles(rank, ENGINE, ROLES, range(8)) is rank


# -- a real daemon, a real engine tree ------------------------------------------------

ENGINE_SCRIPT = r"""
import ctypes, multiprocessing as mp, os, subprocess, sys, threading, time

def compiler(out, tag):
    ctypes.CDLL(None).prctl(15, b"so_compiler-0", 0, 0, 0)  # PR_SET_NAME, as the hook names
    path = os.path.join(out, tag)
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {threading.get_native_id()}")
    os.rename(path + ".tmp", path)
    time.sleep(3600)

def core(out):  # vLLM's EngineCore: a spawn child of the engine, never adopted
    threading.Thread(target=compiler, args=(out, "core"), daemon=True).start()
    time.sleep(3600)

if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "worker":  # an SGLang scheduler: adopted by LOCAL_RANK
        tag = "rank" + os.environ["LOCAL_RANK"]
        threading.Thread(target=compiler, args=(out, tag), daemon=True).start()
        time.sleep(3600)
    mp.get_context("spawn").Process(target=core, args=(out,), daemon=True).start()
    for r in range(2):
        env = dict(os.environ, LOCAL_RANK=str(r))
        subprocess.Popen([sys.executable, __file__, out, "worker"], env=env)
    open(os.path.join(out, "ready"), "w").close()
    time.sleep(3600)
"""


def tree_config(tmp_path: Path, *, cgroup: str, policy: str) -> Path:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    doc: dict[str, Any] = {
        "cpu_ranks": 2,
        "cgroup": cgroup,
        "stop_timeout_s": 2,
        "engine": {"command": ["python", str(script), str(out), "engine"]},
        "ready": {"file": str(out / "ready"), "timeout_s": 30},
        "workers": {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]},
        "placement": {
            "rank_roles": {},
            "on_shortage": "share",
            "engine": {"main_cpus": 1, "roles": {"so_compiler": 1}},
        },
    }
    text = to_toml(doc)
    text += '[threads.so_compiler]\nprocess = "engine"\npattern = "so_compiler-*"\n'
    text += f'[drift]\ncheck_interval_s = 0.2\npolicy = {{ thread_affinity = "{policy}" }}\n'
    path = tmp_path / "tree.toml"
    path.write_text(text)
    return path


def compiler_thread(tmp_path: Path, tag: str) -> tuple[int, int]:
    path = tmp_path / "out" / tag
    poll(path.exists, timeout_s=60, what=f"{tag}'s compiler thread")
    pid, tid = path.read_text().split()
    return int(pid), int(tid)


def cpus_of(pid: int, tid: int) -> str | None:
    return thread_cpus(pid).get(tid)


def planned(d: DaemonProcess) -> dict[str, Any]:
    doc = poll(
        lambda: (p := d.placement()) and all(r["adopted"] for r in p["ranks"]) and p,
        timeout_s=60,
        what="both ranks adopted",
    )
    assert doc["engine"]["roles"] == {"main": [0], "so_compiler": [1]}, doc["engine"]
    assert [r["cpus"] for r in doc["ranks"]] == [[0], [1]]
    return dict(doc)


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


def bind_failures(port: int, rank: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(
        float(line.split()[-1])
        for line in lines
        if line.startswith("placement_bind_failures_total{") and f'rank="{rank}"' in line
    )


def assert_two_cpus() -> None:
    if sorted(os.sched_getaffinity(0)) != [0, 1]:
        pytest.fail("this test is written for CPUs 0-1 (the CI box)")


@pytest.mark.parametrize("policy", ["enforce", "observe"])
def test_a_spawn_child_s_pool_thread_is_checked_with_the_engine(
    tmp_path: Path, policy: str
) -> None:
    assert_two_cpus()
    config = tree_config(tmp_path, cgroup="auto", policy=policy)
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as d:
        doc = planned(d)
        pid, tid = compiler_thread(tmp_path, "core")
        poll(
            lambda: pid in {c["pid"] for c in (d.placement() or doc)["engine"]["children"]},
            timeout_s=20,
            what="the spawn child among the engine's children",
        )
        if policy == "enforce":
            # Bound to so_compiler as a new thread of its role, then moved away and back.
            poll(lambda: cpus_of(pid, tid) == "1", timeout_s=20, what=d.tail())
            os.sched_setaffinity(tid, {0})
            poll(lambda: cpus_of(pid, tid) == "1", timeout_s=20, what=d.tail())
            counter = 'placement_drift_events_total{kind="thread_affinity",rank="engine"}'
            poll(lambda: metric(d.port, counter) >= 1, timeout_s=20, what=d.tail())
        else:
            os.sched_setaffinity(tid, {0})

            def finding() -> dict[str, Any] | None:
                engine = (d.placement() or doc)["engine"]
                # Never bound under observe: drift from its start (0-1), then on 0.
                return next(
                    (
                        f
                        for f in engine["drift"]
                        if f["target"] == f"tid {tid}" and f["actual"] == "0"
                    ),
                    None,
                )

            found = poll(finding, timeout_s=20, what=d.tail())
            assert found == {
                "kind": "thread_affinity",
                "target": f"tid {tid}",
                "expected": "1",
                "actual": "0",
                "action": "observe",
            }
            d.after_checks(3)  # observe never binds it
            assert cpus_of(pid, tid) == "0"
        threads = (d.placement() or doc)["engine"]["observed"]["threads"]
        assert {"tid": tid, "name": "so_compiler-0", "role": "so_compiler", "pid": pid} == {
            k: v for k, v in next(t for t in threads if t["tid"] == tid).items() if k != "cpus"
        }
        # An adopted worker's so_compiler thread in rank 0's cgroup. With a rank
        # cpuset (v2, CPU 0) the engine's CPU 1 is outside it, so it stays on
        # rank 0's main; v1 has no per-rank cpusets (the worker shares the
        # supervisor's, 0-1), so hook and check loop agree on the engine's CPU 1.
        # Either way: no drift, no failed bind.
        if policy == "enforce":
            setup = detect_cgroup_setup(HostFS("/"))
            want = "0" if setup is not None and setup.rank_cpusets else "1"
            wpid, wtid = compiler_thread(tmp_path, "rank0")
            d.after_checks(3)
            assert cpus_of(wpid, wtid) == want
            rank0 = (d.placement() or doc)["ranks"][0]
            assert rank0["pid"] == wpid and rank0["drift"] == []
            assert bind_failures(d.port, "0") == 0
        assert d.stop(timeout_s=30) == 0


def test_an_adopted_worker_s_engine_role_thread_goes_to_the_engine_s_role_cpus(
    tmp_path: Path,
) -> None:
    """With no rank cgroup the engine's so_compiler CPU is inside what the worker
    may use: the thread goes there (as the hook would bind it), main stays."""
    assert_two_cpus()
    config = tree_config(tmp_path, cgroup="off", policy="enforce")
    with DaemonProcess(config, tmp_path / "d.log", env=daemon_env()) as d:
        planned(d)
        pid, tid = compiler_thread(tmp_path, "rank0")
        poll(lambda: cpus_of(pid, tid) == "1", timeout_s=20, what=d.tail())
        assert cpus_of(pid, pid) == "0"
        os.sched_setaffinity(tid, {0})
        poll(lambda: cpus_of(pid, tid) == "1", timeout_s=20, what=d.tail())
        counter = 'placement_drift_events_total{kind="thread_affinity",rank="0"}'
        poll(lambda: metric(d.port, counter) >= 1, timeout_s=20, what=d.tail())
        assert d.stop(timeout_s=30) == 0
