"""The daemon as a container's entrypoint under a cgroup namespace, cgroup v2; run INSIDE
the test guest, as root.

    tests/guest/run-in-vm --nodes 2 -- .venv/bin/python -u tests/vm_checks/cgroupns_delegation.py

Default guest: node 0 = CPUs 0-1, node 1 = CPUs 2-3, cgroup2 at /sys/fs/cgroup.
This script plays the runtime: it makes the container's cgroup (`/ctr`, its
cpuset written here and nowhere else), starts one other process in it, and
starts the daemon the way runc does with a cgroup namespace: joined to `/ctr`,
then `unshare --cgroup --mount` and a fresh cgroup2 mount at /sys/fs/cgroup,
so that the daemon reads "0::/" and a mount root of "/". (1) Delegated: the
daemon moves itself and the other process into a leaf, makes its ranks'
cgroups with their cpusets, follows a cpuset write by the "runtime", and
writes none of `/ctr`'s files but cgroup.subtree_control and nothing of the
host's root (inotify watches both dirs). (2) cpuset not delegated, (3) a
read-only cgroupfs and (4) a host cgroup holding another process (EBUSY):
one "cgroups none" line with the cause, no child cgroups, ready.
Prints "PASS name: detail" / "FAIL name: detail".
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
import subprocess
import sys
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from supervisor.cpulist import format_cpulist, parse_cpulist  # noqa: E402
from tests.support import children  # noqa: E402
from tests.support.daemon_support import DEMO_WORKER, INSTANCE_ENV, DaemonProcess  # noqa: E402
from tests.support.poll import wait_until  # noqa: E402
from tests.support.vm import Checklist  # noqa: E402

CGROUP = "/sys/fs/cgroup"
INSTANCE = "vmns"
LEAF = f"placement-supervisor-{INSTANCE}"
CHECKS = Checklist()
IN_MODIFY = 0x2
# Files the kernel itself reports as modified (kernfs_notify on a state change),
# never written by anyone: cgroup.events, memory.events, pids.events(.local).
NOTIFY_ONLY = (".events", ".events.local")


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return "(gone)"


def cgroup_of(pid: int) -> str:
    return read(f"/proc/{pid}/cgroup")


class Watch:
    """inotify(7) IN_MODIFY on a few dirs: the names of the files written in them."""

    def __init__(self, dirs: list[str]) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.dirs: dict[int, str] = {}
        for d in dirs:
            wd = self.libc.inotify_add_watch(self.fd, d.encode(), IN_MODIFY)
            assert wd >= 0, f"{d}: {os.strerror(ctypes.get_errno())}"
            self.dirs[wd] = d
        self.seen: set[str] = set()

    def written(self) -> set[str]:
        """Every "<dir>/<name>" written since the start (drains the queue)."""
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return set(self.seen)
            off = 0
            while off < len(data):
                wd, _mask, _cookie, size = struct.unpack_from("iIII", data, off)
                name = data[off + 16 : off + 16 + size].split(b"\0", 1)[0].decode()
                if not name.endswith(NOTIFY_ONLY):
                    self.seen.add(f"{self.dirs.get(wd, '?')}/{name}")
                off += 16 + size

    def close(self) -> None:
        os.close(self.fd)


def in_container(ctr: str, *, mount_options: str = "rw") -> list[str]:
    """The prefix that starts a command as runc does with a cgroup namespace (same pid):
    joined to `ctr`, then a new cgroup and mount namespace, cgroup2 mounted afresh."""
    return [
        "sh",
        "-c",
        f'echo $$ > {ctr}/cgroup.procs && exec "$@"',
        "join",
        "unshare",
        "--cgroup",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        # the outer mount off first (mount(8) refuses the same source twice at one point)
        f'umount -l {CGROUP} && mount -t cgroup2 -o {mount_options} ctr {CGROUP} && exec "$@"',
        "mount",
    ]


def config(path: str) -> str:
    write(
        path,
        'cpu_ranks = 2\ncgroup = "auto"\nstop_timeout_s = 5\n'
        f"[workers]\ncommand = {DEMO_WORKER!r}\n".replace("'", '"')
        + "[placement]\nrank_roles = {}\n[placement.engine]\nenabled = false\n"
        "[drift]\ncheck_interval_s = 0.5\n",
    )
    return path


def ready(daemon: DaemonProcess) -> int:
    """The /readyz status code (0 while it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/readyz", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


def capability(daemon: DaemonProcess, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    m = re.search(rf'^placement_capability\{{name="{name}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def make_ctr(ctr: str, cpus: str = "0-3", mems: str = "0-1") -> None:
    os.makedirs(ctr, exist_ok=True)
    if os.path.exists(f"{ctr}/cpuset.cpus"):
        write(f"{ctr}/cpuset.mems", mems)
        write(f"{ctr}/cpuset.cpus", cpus)


def thread_cpus(pid: int) -> frozenset[int]:
    cpus = children.thread_cpus(pid).values()
    return frozenset().union(*(parse_cpulist(c) for c in cpus))


@CHECKS.guarded("ns-delegated")
def delegated() -> None:
    write(f"{CGROUP}/cgroup.subtree_control", "+cpuset +memory")
    ctr = f"{CGROUP}/ctr"
    make_ctr(ctr)
    # Another process of the container's, in its cgroup before the daemon starts.
    other = subprocess.Popen(["sh", "-c", f"echo $$ > {ctr}/cgroup.procs && exec sleep 600"])
    wait_until(lambda: str(other.pid) in read(f"{ctr}/cgroup.procs").split(), 20)
    watch = Watch([CGROUP, ctr])
    env = dict(os.environ, **{INSTANCE_ENV: INSTANCE})
    daemon = DaemonProcess(config("/tmp/ns.toml"), "/tmp/ns.log", env=env, prefix=in_container(ctr))
    inst = f"{ctr}/{LEAF}"
    try:
        doc = wait_until(daemon.running, 180, 0.25)
        CHECKS.check("ns-daemon-up", doc is not None, "both ranks running")
        if doc is None:
            return
        CHECKS.check("ns-ready", wait_until(lambda: ready(daemon) == 200, 30) is True, "/readyz")
        leaf = f"0::/ctr/{LEAF}/supervisor"
        CHECKS.check(
            "ns-everyone-in-leaf",
            cgroup_of(daemon.pid) == leaf
            and cgroup_of(other.pid) == leaf
            and read(f"{ctr}/cgroup.procs") == "",
            f"daemon {cgroup_of(daemon.pid)}, other {cgroup_of(other.pid)}, "
            f"/ctr procs [{read(f'{ctr}/cgroup.procs')}]",
        )
        ranks = {r["rank"]: (r["pid"], frozenset(r["cpus"])) for r in doc["ranks"]}
        detail, ok = [], len(ranks) == 2
        for rank, (pid, cpus) in sorted(ranks.items()):
            rel = f"{inst}/rank{rank}"
            wait_until(lambda pid=pid, cpus=cpus: thread_cpus(pid) <= cpus, 20)  # type: ignore[misc]
            got = parse_cpulist(read(f"{rel}/cpuset.cpus"))
            ok = ok and (
                cgroup_of(pid) == f"0::/ctr/{LEAF}/rank{rank}"
                and got == cpus
                and thread_cpus(pid) <= cpus
            )
            detail.append(f"rank{rank} {cgroup_of(pid)} cpuset {format_cpulist(got)}")
        CHECKS.check("ns-rank-cgroups", ok, "; ".join(detail))

        # The "runtime" shrinks the container's cpuset: never blocked, followed.
        write(f"{ctr}/cpuset.cpus", "0-1")

        def shrunk() -> bool:
            return all(
                parse_cpulist(read(f"{inst}/rank{r}/cpuset.cpus")) <= {0, 1}
                and thread_cpus(pid) <= {0, 1}
                for r, (pid, _) in ranks.items()
            )

        CHECKS.check("ns-follows-runtime", bool(wait_until(shrunk, 30, 0.1)), "cpuset 0-1")
    finally:
        code = daemon.stop(timeout_s=60)
        other.kill()
        other.wait()
        CHECKS.check("ns-clean-stop", code == 0, f"exit code {code}")
        written = watch.written()
        watch.close()
        # The watch works: it saw this script's own write of /ctr's cpuset.cpus.
        # cgroup.procs: the join (as the runtime does); with cgroup.subtree_control
        # the files cgroup-v2.rst "Model of Delegation" hands to a delegatee.
        allowed = {f"{ctr}/{f}" for f in ("cgroup.subtree_control", "cgroup.procs", "cpuset.cpus")}
        CHECKS.check(
            "ns-own-files-untouched",
            f"{ctr}/cpuset.cpus" in written
            and written <= allowed
            and read(f"{ctr}/cpuset.mems") == "0-1"
            and "cpuset" in read(f"{ctr}/cgroup.subtree_control").split(),
            f"written {sorted(written)}; /ctr cpuset.mems {read(f'{ctr}/cpuset.mems')}",
        )
        if CHECKS.failed:
            print(f"--- {daemon.log} ---\n{daemon.tail(5000)}", flush=True)


def undelegated(name: str, ctr: str, cause: str, *, prefix: list[str] | None = None) -> None:
    """The daemon in `ctr` (in a container there, unless `prefix`), which it may not use."""
    env = dict(os.environ, **{INSTANCE_ENV: INSTANCE})
    log = f"/tmp/{name}.log"
    daemon = DaemonProcess(
        config(f"/tmp/{name}.toml"),
        log,
        env=env,
        prefix=in_container(ctr) if prefix is None else prefix,
    )
    try:
        doc = wait_until(daemon.running, 180, 0.25)
        up = doc is not None and wait_until(lambda: ready(daemon) == 200, 30) is True
        CHECKS.check(f"{name}-ready", up, "running and /readyz 200")
        if doc is None:
            return
        # The cgroup setup's own line, and the capability report's summary of it
        # (supervisor.bind.capability): each once, each with the cause.
        text = daemon.tail(200_000).splitlines()
        lines = [line for line in text if "cgroups none" in line]
        summary = [line for line in text if "capability missing name=cgroup" in line]
        CHECKS.check(
            f"{name}-said-once",
            len(lines) == 1 and cause in lines[0] and len(summary) == 1 and cause in summary[0],
            f"{lines} {summary}",
        )
        ranks_in = {cgroup_of(r["pid"]) for r in doc["ranks"]}
        made = [d for d in os.listdir(ctr) if d.startswith("placement-supervisor")]
        CHECKS.check(
            f"{name}-no-child-cgroups",
            not made and ranks_in == {f"0::{ctr[len(CGROUP) :]}"},
            f"dirs {made}, ranks in {ranks_in}",
        )
        cap = capability(daemon, "cgroup")
        CHECKS.check(
            f"{name}-capability", cap == 0.0, f'placement_capability{{name="cgroup"}} {cap}'
        )
    finally:
        code = daemon.stop(timeout_s=60)
        CHECKS.check(f"{name}-clean-stop", code == 0, f"exit code {code}")
        if CHECKS.failed:
            print(f"--- {daemon.log} ---\n{daemon.tail(5000)}", flush=True)


@CHECKS.guarded("nocpuset")
def not_delegated() -> None:
    # cpuset enabled at the root but not in /nocpu: /nocpu/ctr lists memory only.
    write(f"{CGROUP}/cgroup.subtree_control", "+cpuset +memory")
    os.makedirs(f"{CGROUP}/nocpu/ctr", exist_ok=True)
    write(f"{CGROUP}/nocpu/cgroup.subtree_control", "+memory")
    undelegated("nocpuset", f"{CGROUP}/nocpu/ctr", "cpuset is not delegated to /")


@CHECKS.guarded("rofs")
def read_only() -> None:
    ctr = f"{CGROUP}/roctr"
    make_ctr(ctr)
    undelegated("rofs", ctr, "mounted read-only", prefix=in_container(ctr, mount_options="ro"))


@CHECKS.guarded("busy")
def busy() -> None:
    # A host service cgroup (no namespace: not the container's, so only the
    # daemon moves) that holds another process: enabling controllers gets EBUSY.
    ctr = f"{CGROUP}/busy"
    make_ctr(ctr)
    other = subprocess.Popen(["sh", "-c", f"echo $$ > {ctr}/cgroup.procs && exec sleep 600"])
    try:
        wait_until(lambda: str(other.pid) in read(f"{ctr}/cgroup.procs").split(), 20)
        join = ["sh", "-c", f'echo $$ > {ctr}/cgroup.procs && exec "$@"', "join"]
        undelegated("busy", ctr, "EBUSY", prefix=join)
    finally:
        other.kill()
        other.wait()


def main() -> int:
    if os.environ.get("PS_GUEST") != "1":
        print("run me inside the test guest (tests/guest/run-in-vm)", file=sys.stderr)
        return 2
    delegated()
    not_delegated()
    read_only()
    busy()
    return CHECKS.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
