"""The daemon as PID 1 of a real runc container with a cgroup namespace, cgroup v2; run
INSIDE the test guest, as root.

    tests/guest/run-in-vm --nodes 2 -- .venv/bin/python -u tests/vm_checks/runc_cgroupns.py

Default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3, cgroup2 at /sys/fs/cgroup,
no systemd (runc's cgroupfs driver). The bundle is tests/support/oci.py's
privileged one plus a cgroup namespace (docker's default on v2): runc mounts
cgroup2 read-write with the container's cgroup as its "/". The daemon must
move itself into a leaf, make its ranks' cgroups with their cpusets below
the container's cgroup, follow `runc update --cpuset-cpus` without blocking
it, and leave `runc exec` working (runc joins the init's cgroup when the
container's is busy). Prints "PASS name: detail" / "FAIL name: detail".
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from supervisor.cpulist import format_cpulist, parse_cpulist  # noqa: E402
from tests.support import children  # noqa: E402
from tests.support.daemon_support import DEMO_WORKER, free_port  # noqa: E402
from tests.support.oci import (  # noqa: E402
    Profile,
    daemon_process,
    make_bundle,
    runc,
    running,
    state,
)
from tests.support.poll import wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402

CGROUP = "/sys/fs/cgroup"
CID = "psns"
CTR = f"{CGROUP}/runc-{CID}"
LEAF = f"placement-supervisor-{CID}"
CHECKS = Checklist()


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except FileNotFoundError:
        return "(gone)"


def placement(port: int) -> dict | None:  # type: ignore[type-arg]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/placement", timeout=5) as r:
            doc: dict = json.loads(r.read())  # type: ignore[type-arg]
    except OSError:
        return None
    ranks = doc.get("ranks") or []
    ok = len(ranks) == 2 and all(r["state"] == "running" and r["pid"] for r in ranks)
    return doc if ok else None


def thread_cpus(pid: int) -> frozenset[int]:
    cpus = children.thread_cpus(pid).values()
    return frozenset().union(*(parse_cpulist(c) for c in cpus))


@CHECKS.guarded("runc-ns")
def scenario() -> None:
    tmp = Path(tempfile.mkdtemp())
    config = tmp / "ns.toml"
    config.write_text(
        'cpu_ranks = 2\ncgroup = "auto"\nstop_timeout_s = 5\n'
        f"[workers]\ncommand = {DEMO_WORKER!r}\n".replace("'", '"')
        + "[placement]\nrank_roles = {}\n[placement.engine]\nenabled = false\n"
        "[drift]\ncheck_interval_s = 0.5\n"
    )
    port = free_port()
    args, env = daemon_process(config, CID, port)
    bundle = tmp / "bundle"
    spec = make_bundle(
        bundle,
        args,
        env,
        cgroups_path=f"/runc-{CID}",
        cpus="0-3",
        profile=Profile(privileged=True),
        binds=[str(tmp)],
    )
    # `runc spec` on a v2 host puts a cgroup namespace in already; made sure of here.
    namespaces = spec["linux"]["namespaces"]
    if not any(n["type"] == "cgroup" for n in namespaces):
        namespaces.append({"type": "cgroup"})
    spec["linux"]["resources"]["cpu"]["mems"] = "0-1"
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))
    with running(bundle, CID, tmp / "runc.log"):
        doc = wait_until(lambda: placement(port), 180, 0.25)
        CHECKS.check("runc-ns-up", doc is not None, "both ranks running")
        if doc is None:
            return
        init = int(json.loads(runc("state", CID).stdout)["pid"])
        CHECKS.check(
            "runc-ns-daemon-in-leaf",
            read(f"/proc/{init}/cgroup") == f"0::/runc-{CID}/{LEAF}/supervisor"
            and read(f"{CTR}/cgroup.procs") == "",
            f"init {read(f'/proc/{init}/cgroup')}, container procs [{read(f'{CTR}/cgroup.procs')}]",
        )
        ranks = {r["rank"]: (r["pid"], frozenset(r["cpus"])) for r in doc["ranks"]}
        detail, ok = [], True
        for rank, (_, cpus) in sorted(ranks.items()):
            rel = f"{CTR}/{LEAF}/rank{rank}"
            procs = read(f"{rel}/cgroup.procs").split()
            got = parse_cpulist(read(f"{rel}/cpuset.cpus"))
            ok = ok and bool(procs) and got == cpus
            detail.append(f"rank{rank} procs {procs} cpuset {format_cpulist(got)}")
        CHECKS.check("runc-ns-rank-cgroups", ok, "; ".join(detail))
        done = runc("update", "--cpuset-cpus", "0-1", CID, check=False)

        def shrunk() -> bool:
            return all(
                parse_cpulist(read(f"{CTR}/{LEAF}/rank{r}/cpuset.cpus")) <= {0, 1} for r in ranks
            )

        CHECKS.check(
            "runc-ns-update-followed",
            done.returncode == 0 and bool(wait_until(shrunk, 30, 0.1)),
            f"runc update rc={done.returncode} {done.stderr.strip()}; "
            f"container cpuset.cpus {read(f'{CTR}/cpuset.cpus')}",
        )
        # The container's cgroup is busy (controllers on for its children): runc
        # puts the exec'd process in the init's cgroup, the leaf (runc PR #2416).
        ex = runc("exec", "--cwd", "/", CID, "cat", "/proc/self/cgroup", check=False)
        CHECKS.check(
            "runc-ns-exec-works",
            ex.returncode == 0 and ex.stdout.strip() == f"0::/{LEAF}/supervisor",
            f"rc={ex.returncode} out={ex.stdout.strip()!r} err={ex.stderr.strip()!r}",
        )
        runc("kill", CID, "TERM", check=False)
        stopped = wait_until(lambda: state(CID) in ("stopped", "gone"), 30, 0.1)
        left = [d for d in ("rank0", "rank1") if os.path.exists(f"{CTR}/{LEAF}/{d}")]
        CHECKS.check("runc-ns-clean-stop", bool(stopped) and not left, f"left {left}")


def main() -> int:
    if os.environ.get("PS_GUEST") != "1":
        print("run me inside the test guest (tests/guest/run-in-vm)", file=sys.stderr)
        return 2
    scenario()
    return CHECKS.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
