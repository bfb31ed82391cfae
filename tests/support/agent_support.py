"""Real engine containers for the node agent's tests and benchmark (tests only; does I/O).

A fake `vllm serve` launcher (the engine kind its command line names) that
spawns its workers as vLLM's API server does, each a `python -c` with
LOCAL_RANK in its environment and threads of its own; OCI bundles for it
(tests/support/oci.py's make_bundle); the agent as a real `python -m
supervisor agent` subprocess; and the removal of cgroup parents runc leaves
outside the kubelet's layout (runc removes a container's own cgroup on delete,
never the parents it made).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.cpulist import format_cpulist, parse_cpulist
from tests.support.children import thread_cpus
from tests.support.daemon_support import REPO, daemon_env, free_port, get_json, stop_process
from tests.support.oci import Profile, make_bundle, remove_cgroup_tree

# argv[1:] of a worker: its thread count. Its threads sleep: a quiet engine, so a
# benchmark's baseline is the host's own noise.
WORKER = (
    "import sys, threading, time\n"
    "for _ in range(int(sys.argv[1])):\n"
    "    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    "time.sleep(3600)\n"
)
ENGINE = """#!{python}
import os, subprocess, sys, time
# A fake `vllm serve`: FAKE_RANKS workers as vLLM's API server spawns them, each
# with LOCAL_RANK (the rank the supervisor adopts it as) and FAKE_THREADS threads.
WORKER = {worker!r}
ranks, threads = int(os.environ.get("FAKE_RANKS", "2")), os.environ.get("FAKE_THREADS", "1")
for rank in range(ranks):
    subprocess.Popen([sys.executable, "-c", WORKER, threads],
                     env=dict(os.environ, LOCAL_RANK=str(rank)))
time.sleep(3600)
"""

# The children's config: two ranks by LOCAL_RANK, a quick check loop (the tests'
# waits are shorter for it), no IRQs (the agent's default).
BASE = """cpu_ranks = {ranks}
stop_timeout_s = 2
[workers]
rank_from = ["env:LOCAL_RANK"]
[placement]
rank_roles = {{}}
on_shortage = "share"
{drift}"""
QUICK_DRIFT = "[drift]\ncheck_interval_s = 0.5\n"


def base_config(ranks: int = 2, drift: str = QUICK_DRIFT) -> str:
    return BASE.format(ranks=ranks, drift=drift)


def write_engine(tmp: Path) -> Path:
    """The fake `vllm` script in `tmp`/bin (bind-mounted into the containers)."""
    script = tmp / "bin/vllm"
    script.parent.mkdir(exist_ok=True)
    script.write_text(ENGINE.format(python=sys.executable, worker=WORKER))
    script.chmod(0o755)
    return script


def binds_for(tmp: Path) -> list[str]:
    """What a container must see besides make_bundle's own: `tmp` and this venv
    when it lies outside the checkout (a git worktree's tests use the main one's)."""
    venv = Path(sys.executable).parent.parent
    return [str(tmp)] + ([] if venv.is_relative_to(REPO) else [str(venv)])


def engine_bundle(
    bundle: Path,
    tmp: Path,
    cgroups_path: str,
    cpus: str,
    *,
    ranks: int = 2,
    threads: int = 1,
) -> dict[str, Any]:
    """An OCI bundle of the fake engine in `cgroups_path`, allowed `cpus`."""
    script = tmp / "bin/vllm"
    if not script.exists():
        write_engine(tmp)
    env = {"PATH": "/usr/bin:/bin", "FAKE_RANKS": str(ranks), "FAKE_THREADS": str(threads)}
    return make_bundle(
        bundle,
        [sys.executable, str(script), "serve", "m"],
        env,
        cgroups_path=cgroups_path,
        cpus=cpus,
        profile=Profile(privileged=False),
        binds=binds_for(tmp),
    )


@contextlib.contextmanager
def cgroup_parents(*tops: str) -> Iterator[None]:
    """Removes, afterwards, cgroup dirs runc made as parents of the test's
    containers outside the kubelet's layout (oci.kubelet_parents has that one):
    each of `tops` ("ps-ctr-x", a runtime namespace's) in every hierarchy."""
    hierarchies = [h for h in Path("/sys/fs/cgroup").iterdir() if h.is_dir()]
    try:
        yield
    finally:
        for hierarchy in hierarchies:
            for top in tops:
                remove_cgroup_tree(hierarchy / top.strip("/"))


@dataclass(frozen=True, slots=True)
class Agent:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def containers(self) -> list[dict[str, Any]] | None:
        """GET /placement's containers; None while it does not answer."""
        try:
            docs: list[dict[str, Any]] = get_json(f"{self.url}/placement")["containers"]
        except OSError:
            return None
        return docs


@contextlib.contextmanager
def agent_running(
    tmp: Path,
    *,
    pods: Sequence[str],
    base: str,
    interval_s: float | None = 1.0,
    argv: Sequence[str] | None = None,
    prefix: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> Iterator[Agent]:
    """`python -m supervisor agent` for `pods`, its children's config `base`
    (interval_s None: the agent's default); SIGTERM (then KILL) afterwards.
    `argv` replaces `python -m supervisor` (a benchmark's own entry point);
    `prefix` runs before it and execs it (ray_support.PRIVATE_DEV_PREFIX); `extra`
    are more of the agent's options."""
    (tmp / "base.toml").write_text(base)
    port = free_port()
    args = [*prefix, *(argv or (sys.executable, "-m", "supervisor")), "agent"]
    args += ["--listen", f"127.0.0.1:{port}", "--base-config", str(tmp / "base.toml")]
    args += ["--state-dir", str(tmp / "state")]
    args += [] if interval_s is None else ["--interval-s", str(interval_s)]
    for pod in pods:
        args += ["--pod", pod]
    args += extra
    log = tmp / "agent.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, cwd=REPO, env=daemon_env(), stdout=subprocess.DEVNULL, stderr=out
        )
    try:
        yield Agent(proc, f"http://127.0.0.1:{port}", log)
    finally:
        stop_process(proc, 60)


def placed(entry: dict[str, Any], ranks: int = 2) -> bool:
    """The container's `ranks` workers adopted, each with every thread on its
    rank's planned CPUs, all within the container's share."""
    doc = entry.get("placement")
    if entry["state"] != "running" or not doc or len(doc["ranks"]) != ranks:
        return False
    share = parse_cpulist(entry["share"])
    for r in doc["ranks"]:
        if r["state"] != "running" or not r["adopted"] or not r.get("pid"):
            return False
        cpus = set(thread_cpus(r["pid"]).values())
        if cpus != {format_cpulist(r["cpus"])} or not parse_cpulist(cpus.pop()) <= share:
            return False
    return True


def rank_cpus(entry: dict[str, Any]) -> dict[int, str]:
    """rank -> its planned CPUs, from the child's /placement in `entry`."""
    return {r["rank"]: format_cpulist(r["cpus"]) for r in entry["placement"]["ranks"]}


def worker_pids(entry: dict[str, Any]) -> dict[int, int]:
    return {r["rank"]: r["pid"] for r in entry["placement"]["ranks"]}
