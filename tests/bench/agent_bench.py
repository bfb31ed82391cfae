"""Benchmark: the node agent's CPU with 10 engine containers x 8 ranks x 100 threads.

Run as root with runc: `.venv/bin/python -m tests.bench.agent_bench [--quick]`.
Ten real runc containers in the kubelet's cgroupfs layout, one pod, each a fake
`vllm serve` (tests/support/agent_support.py) whose 8 workers (LOCAL_RANK 0-7)
hold 100 sleeping threads each. Then:

(a) quiet baseline: the same containers, no agent, for the window: the host's
    busy CPU (/proc/stat) and the containers' own (utime+stime, proc(5)).
(b) the agent with its defaults (`--interval-s` 2; `[drift]` left out, so the
    children's: checks every 10 s, numa_maps every 60 s, no cpuset watch;
    supervisor.agent.node), once all ten
    containers are placed and a settle time has passed: utime+stime of the
    agent and every process below it (the ten child supervisors) over the
    window, as % of one core (target < 1%), with the host's busy CPU beside
    the baseline's (their ratio), and where the time goes: per process, the
    busiest threads of the agent and of one child, the children's mean check
    pass (`placement_check_duration_seconds`).

Each container gets a CPU of its own where the host has ten; on a smaller host
they all get the whole set and, so that ten children still run, the agent is
run with its shares not split (this module's `--unsplit-agent` entry: every
container's share is its whole cpuset): the split only chooses each child's
CPUs, not its work. The output says which. Everything is removed afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tests.support.agent_support import (
    agent_running,
    base_config,
    engine_bundle,
    placed,
)
from tests.support.daemon_support import get_json
from tests.support.oci import kubelet_parents, running
from tests.support.poll import poll

CONTAINERS, RANKS, THREADS = 10, 8, 100
TARGET_CORE_PERCENT = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


def stat_fields(path: str) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of a /proc stat file; None once it is gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def cpu_s(path: str) -> float | None:
    """utime + stime (proc(5) fields 14 and 15) of a stat file, in seconds."""
    got = stat_fields(path)
    return None if got is None else (int(got[1][11]) + int(got[1][12])) / CLK_TCK


def host_busy_s() -> float:
    """Seconds the host's CPUs were busy since boot (/proc/stat: all but idle and iowait)."""
    words = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(w) for w in words[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK


def descendants(root: int) -> list[int]:
    """`root` and every process below it, now."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            got = stat_fields(f"/proc/{name}/stat")
            if got is not None:
                parent[int(name)] = int(got[1][1])
    out, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parent.items() if ppid in frontier]
        out += frontier
    return out


def thread_cpu(pid: int) -> dict[str, float]:
    """ "<tid> <name>" -> utime+stime of each thread of `pid` (its executor threads
    share the name "python": the tid tells them apart, the main thread's is `pid`)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            got = stat_fields(f"/proc/{pid}/task/{tid}/stat")
            if got is not None:
                comm, f = got
                label = f"{'main' if int(tid) == pid else tid} {comm}"
                out[label] = (int(f[11]) + int(f[12])) / CLK_TCK
    return out


def per_process(pids: list[int]) -> dict[int, float]:
    return {pid: s for pid in pids if (s := cpu_s(f"/proc/{pid}/stat")) is not None}


def window(pids: list[int], window_s: float) -> dict[str, Any]:
    """CPU seconds per process (those alive at both ends) and the host's, over `window_s`."""
    host0, t0 = host_busy_s(), time.monotonic()
    cpu0 = per_process(pids)
    threads0 = {pid: thread_cpu(pid) for pid in pids}
    time.sleep(window_s)  # the measured window: nothing is done in it
    cpu1 = per_process(pids)
    threads1 = {pid: thread_cpu(pid) for pid in pids}
    host1, t1 = host_busy_s(), time.monotonic()
    both = cpu0.keys() & cpu1.keys()
    return {
        "elapsed_s": t1 - t0,
        "host_s": host1 - host0,
        "cpu_s": {pid: cpu1[pid] - cpu0[pid] for pid in both},
        "threads_s": {
            pid: {n: threads1[pid][n] - threads0[pid].get(n, 0.0) for n in threads1[pid]}
            for pid in both
        },
    }


def metric_sums(text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def pct(seconds: float, elapsed_s: float) -> float:
    return 100.0 * seconds / elapsed_s


def top(threads: Mapping[str, float], elapsed_s: float, n: int = 5) -> str:
    busiest = sorted(threads.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{name} {pct(s, elapsed_s):.2f}%" for name, s in busiest)


def agent_look_ms(pod: str, looks: int = 20) -> float:
    """CPU ms of one of the agent's looks at the node (its pass less the children's upkeep)."""
    from supervisor.agent.node import AgentOptions, NodeAgent  # noqa: PLC0415

    agent = NodeAgent(AgentOptions(listen=("127.0.0.1", 0), pods=(pod,)))
    agent.engines()
    t0 = time.process_time()
    for _ in range(looks):
        agent.engines()
    return 1000 * (time.process_time() - t0) / looks


def unsplit_agent(argv: list[str]) -> int:
    """`python -m supervisor` with every container's share its whole cpuset (see above)."""
    from supervisor.agent import node  # noqa: PLC0415 - this entry only
    from supervisor.agent.shares import Share  # noqa: PLC0415
    from supervisor.cli import main as cli_main  # noqa: PLC0415

    def whole(sets: Mapping[str, frozenset[int]]) -> dict[str, Share]:
        return {name: Share(cpus) for name, cpus in sets.items()}

    setattr(node, "compute_shares", whole)  # noqa: B010 - the bench swaps the split out
    return cli_main(argv)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--unsplit-agent"]:
        return unsplit_agent(args_in[1:])
    p = argparse.ArgumentParser(prog="python -m tests.bench.agent_bench")
    p.add_argument("--quick", action="store_true", help="15 s windows instead of 60 s")
    p.add_argument("--settle-s", type=float, default=20.0, help="after all are placed (20)")
    p.add_argument(
        "--check-interval-s",
        type=float,
        help="the children's [drift] check_interval_s (default: left out, the agent's 10 s)",
    )
    args = p.parse_args(args_in)
    if os.geteuid() != 0 or shutil.which("runc") is None:
        print("skip: needs root and runc")
        return 0
    window_s = 15.0 if args.quick else 60.0
    allowed = sorted(os.sched_getaffinity(0))
    split = len(allowed) >= CONTAINERS
    cpus = [str(allowed[i]) if split else f"{allowed[0]}-{allowed[-1]}" for i in range(CONTAINERS)]
    pod = str(uuid.uuid4())
    cids = sorted(uuid.uuid4().hex + uuid.uuid4().hex for _ in range(CONTAINERS))
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        stack.enter_context(kubelet_parents(pod))
        for cid, c in zip(cids, cpus, strict=True):
            bundle = tmp / cid[:12]
            path = f"/kubepods/besteffort/pod{pod}/{cid}"
            engine_bundle(bundle, tmp, path, c, ranks=RANKS, threads=THREADS)
            stack.enter_context(running(bundle, cid[:32], tmp / f"{cid[:12]}.runc.log"))
        engines = _engine_pids(pod)
        poll(
            lambda: (
                len(engines()) == CONTAINERS * (RANKS + 1)
                and all(len(os.listdir(f"/proc/{p}/task")) > THREADS for p in _workers(engines()))
            ),
            180,
            0.5,
            what="every engine, worker and thread started",
        )
        print(
            f"{CONTAINERS} runc containers x {RANKS} ranks x {THREADS} threads "
            f"({sum(len(os.listdir(f'/proc/{p}/task')) for p in engines())} threads), "
            f"CPUs {','.join(str(c) for c in allowed)}, "
            + ("one CPU per container" if split else "each allowed all (shares not split)")
        )
        print(f"load average before: {_loadavg()}")
        quiet = window(engines(), window_s)
        argv_agent = None if split else [sys.executable, "-m", "tests.bench.agent_bench"]
        entry = [*argv_agent, "--unsplit-agent"] if argv_agent else None
        (tmp / "agent").mkdir()
        every = args.check_interval_s
        drift = "" if every is None else f"[drift]\ncheck_interval_s = {every}\n"
        print(f"children's check_interval_s: {'default' if every is None else every}")
        with agent_running(
            tmp / "agent",
            pods=[pod],
            base=base_config(RANKS, drift=drift),
            interval_s=None,
            argv=entry,
        ) as agent:

            def all_placed() -> list[dict[str, Any]] | None:
                docs = agent.containers()
                ok = docs is not None and len(docs) == CONTAINERS
                return docs if ok and all(placed(e, RANKS) for e in docs or ()) else None

            t_place = time.monotonic()
            poll(all_placed, 600, 2.0, what="all containers placed")
            placed_s = time.monotonic() - t_place
            time.sleep(args.settle_s)  # settle: the children's first passes name every thread
            metrics0 = _get(f"{agent.url}/metrics")
            tree = descendants(agent.proc.pid)
            busy = window(tree, window_s)
            metrics1 = _get(f"{agent.url}/metrics")
            docs = get_json(f"{agent.url}/placement")["containers"]
            load = _loadavg()
        look_ms = agent_look_ms(pod)
        _report(
            quiet=quiet,
            busy=busy,
            agent_pid=agent.proc.pid,
            docs=docs,
            metrics0=metrics0,
            metrics1=metrics1,
            placed_s=placed_s,
            load=load,
        )
        hosts = sum(1 for n in os.listdir("/proc") if n.isdigit())
        print(
            f"    the agent's look at the node (find_containers, in this process): "
            f"{look_ms:.1f} ms CPU each, {hosts} processes on the host, one look every 2 s"
        )
    return 0


def _report(
    *,
    quiet: dict[str, Any],
    busy: dict[str, Any],
    agent_pid: int,
    docs: list[dict[str, Any]],
    metrics0: str,
    metrics1: str,
    placed_s: float,
    load: str,
) -> None:
    el_q, el_b = quiet["elapsed_s"], busy["elapsed_s"]
    children = {d["child_pid"] for d in docs}
    cpu = busy["cpu_s"]
    total = sum(cpu.values())
    agent_s = cpu.get(agent_pid, 0.0)
    child_s = [cpu[p] for p in children if p in cpu]
    other_s = total - agent_s - sum(child_s)
    name = "placement_check_duration_seconds"
    checks = metric_sums(metrics1, f"{name}_count") - metric_sums(metrics0, f"{name}_count")
    spent = metric_sums(metrics1, f"{name}_sum") - metric_sums(metrics0, f"{name}_sum")
    print(f"all {len(docs)} placed {placed_s:.0f} s after the agent started")
    print(
        f"(a) quiet baseline, {el_q:.0f} s, no agent: host busy "
        f"{pct(quiet['host_s'], el_q):.2f}% of one core, the containers' own "
        f"{pct(sum(quiet['cpu_s'].values()), el_q):.2f}%"
    )
    verdict = "met" if pct(total, el_b) < TARGET_CORE_PERCENT else "MISSED"
    print(
        f"(b) agent + {len(child_s)} children, {el_b:.0f} s: {pct(total, el_b):.2f}% of one core "
        f"(target < {TARGET_CORE_PERCENT:g}%: {verdict}); agent {pct(agent_s, el_b):.2f}%, "
        f"children {pct(sum(child_s), el_b):.2f}% "
        f"(each {pct(min(child_s), el_b):.2f}-{pct(max(child_s), el_b):.2f}%), "
        f"other processes below the agent {pct(other_s, el_b):.2f}%"
    )
    print(
        f"    host busy {pct(busy['host_s'], el_b):.2f}% vs {pct(quiet['host_s'], el_q):.2f}% "
        f"quiet: ratio {pct(busy['host_s'], el_b) / max(pct(quiet['host_s'], el_q), 0.01):.1f}x"
    )
    if checks:
        print(
            f"    children's check passes: {checks:.0f} in the window "
            f"({checks / el_b / max(len(child_s), 1):.2f}/s each), mean "
            f"{1000 * spent / checks:.1f} ms, {pct(spent, el_b):.2f}% of one core in passes"
        )
    print(f"    agent's threads: {top(busy['threads_s'].get(agent_pid, {}), el_b)}")
    one = max((p for p in children if p in cpu), key=lambda p: cpu[p], default=None)
    if one is not None:
        print(f"    busiest child's threads: {top(busy['threads_s'].get(one, {}), el_b)}")
    print(f"load average after: {load}")


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _engine_pids(pod: str) -> Callable[[], list[int]]:
    """A function: the pids in the pod's containers now (cgroup.procs of each, v1 cpuset)."""
    base = Path(f"/sys/fs/cgroup/cpuset/kubepods/besteffort/pod{pod}")
    if not base.is_dir():
        base = Path(f"/sys/fs/cgroup/kubepods/besteffort/pod{pod}")

    def pids() -> list[int]:
        out: list[int] = []
        for procs in base.glob("*/cgroup.procs"):
            with contextlib.suppress(OSError):
                out += [int(x) for x in procs.read_text().split()]
        return out

    return pids


def _workers(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if b"LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes():
                out.append(pid)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
