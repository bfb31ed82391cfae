"""Benchmark: one `ready.tcp` ownership check against 1,000 and 100,000 sockets.

Run (root: it makes a private network namespace per size with `unshare -n`):
`.venv/bin/python -m tests.bench.listener_bench [--quick]`. In each namespace
holder processes keep N established TCP sockets open and a real child listens;
every number is a median over repeated calls, measured in the same namespace:

- new: `check_listener_owner` (listeners from sock_diag, then the engine
  tree's fd links), the sock_diag dump alone, and the dump from a thread
  that joins the engine's namespace (setns, for an engine in another one);
- fallback: the LISTEN rows streamed from /proc/<pid>/net/tcp{,6} (another
  namespace, a fixture tree);
- old: both whole tables read (without the 1 MiB cap that made it raise past
  ~7,000 sockets) and every row parsed, then the same tree and fd match.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def measure(sockets: int, repeat: int) -> dict[str, float]:
    done = subprocess.run(
        [
            *("unshare", "-n", sys.executable, "-m", "tests.support.socket_flood"),
            *("--sockets", str(sockets), "--repeat", str(repeat)),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    if result["owner"] is not None:
        raise SystemExit(f"the owner was not found at {sockets} sockets: {result['owner']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args(argv)
    repeat = 5 if args.quick else 21
    print(
        f"{'sockets':>8} {'rows':>8} {'new ms':>8} {'dump ms':>8} {'setns ms':>8} "
        f"{'stream ms':>10} {'old ms':>8} {'old/new':>8} {'old/stream':>10}"
    )
    for sockets in (1_000, 100_000):
        r = measure(sockets, repeat)
        new, old, stream = r["netlink_s"], r["old_s"], r["stream_s"]
        print(
            f"{sockets:>8} {int(r['tcp_rows']):>8} {new * 1e3:>8.2f} {r['dump_s'] * 1e3:>8.3f} "
            f"{r['dump_in_s'] * 1e3:>8.3f} "
            f"{stream * 1e3:>10.1f} {old * 1e3:>8.1f} {old / new:>7.0f}x {old / stream:>9.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
