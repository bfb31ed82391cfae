"""Start the daemon inside given cgroups, as an orchestrator would confine it (a test launcher).

    python tests/vm_checks/checker_daemon.py [--join DIR/cgroup.procs ...] -- run --config FILE ...

Writes its own pid into each `--join` file (cgroup v1 `cgroup.procs` or
`tasks`, or a v2 `cgroup.procs`), then execs `python -m supervisor` with the
rest of the arguments: same pid, so the daemon starts already confined. Used
by tests/daemon_support.py's DaemonProcess (`join=`).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: checker_daemon.py [--join FILE ...] -- SUPERVISOR-ARGS", file=sys.stderr)
        return 2
    split = argv.index("--")
    options, rest = argv[:split], argv[split + 1 :]
    if len(options) % 2 or any(opt != "--join" for opt in options[::2]):
        print(f"checker_daemon.py: expected --join FILE pairs, got {options}", file=sys.stderr)
        return 2
    for procs in options[1::2]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    os.execv(sys.executable, [sys.executable, "-m", "supervisor", *rest])
    return 127  # not reached: execv returns only by raising


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
