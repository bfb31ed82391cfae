"""A network namespace crowded with TCP sockets, for the listener-ownership test and bench.

Run inside a private namespace (`unshare -n python -m tests.support.socket_flood`,
root): brings loopback up, opens SOCKETS established sockets (pairs to a filler
listener held by this process, across 127.0.0.x so the ephemeral ports last),
starts a real child that listens on a port, checks the child owns it, and
prints one JSON line with what it found and how long each way took.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable

from supervisor.bind.sock_diag import dump_tcp_listeners, dump_tcp_listeners_in
from supervisor.hostfs import HostFS, SpecialFileError
from supervisor.run.listeners import (
    check_listener_owner,
    parse_listeners,
    same_netns,
    serves,
    socket_inodes,
    stream_listeners,
    tree_pids,
)

FS = HostFS("/")
CHILD_LISTENER = r"""
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
print(s.getsockname()[1], flush=True)
sys.stdin.read()  # until the parent closes our stdin
"""
# A holder process: `count` established sockets (count // 2 pairs to its own
# filler listener, across 127.0.x.y so no destination runs out of ephemeral
# ports), held open until its stdin closes.
HOLDER = r"""
import resource, socket, sys
_soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
count = int(sys.argv[1])
filler = socket.socket()
filler.bind(("0.0.0.0", 0))
filler.listen(128)
port = filler.getsockname()[1]
held = [filler]
for i in range(count // 2):
    client = socket.socket()
    client.connect((f"127.0.{1 + i // 250}.{1 + i % 250}", port))
    held += (client, filler.accept()[0])
print(len(held), flush=True)
sys.stdin.read()
"""


def in_private_netns() -> None:
    """Loopback up and a wide ephemeral range (per-namespace sysctl, ip(8))."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
        f.write("10000 60999")


def per_process_sockets() -> int:
    """Sockets one holder may open: RLIMIT_NOFILE raised to its hard limit
    (raising the hard limit needs CAP_SYS_RESOURCE, which a container may lack)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (min(hard, 1 << 20) - 64) // 2 * 2


def flood(count: int) -> list[subprocess.Popen[str]]:
    """`count` established TCP sockets in this namespace, held by holder processes
    (as many as one process's RLIMIT_NOFILE allows each), all started in parallel."""
    each = per_process_sockets()
    holders = []
    left = count
    while left > 0:
        n = min(each, left)
        holders.append(
            subprocess.Popen(
                [sys.executable, "-c", HOLDER, str(n)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        left -= n
    for holder in holders:
        assert holder.stdout is not None
        holder.stdout.readline()
    return holders


def median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def old_check(pid: int, host: str, port: int) -> bool:
    """The old ownership check without its read cap: both whole tables read and
    every row parsed, then the same tree and fd match as `check_listener_owner`."""
    wanted: set[int] = set()
    for table in ("tcp", "tcp6"):
        with open(FS.path(f"proc/{pid}/net/{table}"), "rb") as f:
            rows = parse_listeners(f.read().decode())
        wanted |= {r.inode for r in rows if serves(r, host, port)}
    return any(socket_inodes(FS, member) & wanted for member in tree_pids(FS, pid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sockets", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=0, help="time each way this many times")
    args = parser.parse_args(argv)
    in_private_netns()
    t0 = time.monotonic()
    holders = flood(args.sockets)
    flood_s = time.monotonic() - t0
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_LISTENER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        rows = sum(1 for _ in FS.iter_lines(f"proc/{child.pid}/net/tcp")) - 1
        try:
            FS.read_text(f"proc/{child.pid}/net/tcp")
            capped_read = "ok"
        except SpecialFileError as err:
            capped_read = str(err)
        out: dict[str, object] = {
            "holders": len(holders),
            "tcp_rows": rows,
            "flood_s": round(flood_s, 2),
            "same_netns": same_netns(FS, child.pid),
            "owner": check_listener_owner(FS, child.pid, "127.0.0.1", port),
            "stranger": check_listener_owner(FS, holders[0].pid, "127.0.0.1", port),
            "streamed_ports": sorted({r.port for r in stream_listeners(FS, child.pid)}),
            "port": port,
            "capped_read": capped_read,
        }
        if args.repeat:
            check = lambda: check_listener_owner(FS, child.pid, "127.0.0.1", port)  # noqa: E731
            out["netlink_s"] = median_s(check, args.repeat)
            out["dump_s"] = median_s(dump_tcp_listeners, args.repeat)
            netns = FS.path(f"proc/{child.pid}/ns/net")
            out["dump_in_s"] = median_s(lambda: dump_tcp_listeners_in(netns), args.repeat)
            out["stream_s"] = median_s(lambda: stream_listeners(FS, child.pid), args.repeat)
            assert old_check(child.pid, "127.0.0.1", port)
            out["old_s"] = median_s(lambda: old_check(child.pid, "127.0.0.1", port), args.repeat)
        print(json.dumps(out), flush=True)
    finally:
        child.kill()
        child.wait()
        for holder in holders:
            holder.kill()
            holder.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
