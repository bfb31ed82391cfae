"""A private containerd for tests (tests only; does I/O: containerd, ctr, files).

`private_containerd(tmp)` starts Debian's `containerd` with its own root, state
and socket under `tmp` and a config without the CRI plugin (no Kubernetes, no
image registry) or the `opt` plugin (it would make /opt/containerd); `ctr run
-c SPEC` runs a container from a whole OCI spec (tests/support/oci.py's
make_bundle: root directory, bind mounts, cgroupsPath, cpuset), through the
runc v2 shim, with the shim's runc state under `tmp` too (`--runc-root`).

Afterwards every task is killed and deleted, the containerd stopped, any shim
of this socket still there killed, and the dirs the shim makes below
/run/containerd (its sockets, `s/`) removed when this run made them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.poll import poll, wait_until

# containerd-shim-runc-v2 puts its socket in /run/containerd/s whatever the
# daemon's --state says (containerd 1.6 runtime/v2/shim/util_unix.go, SocketAddress).
SHIM_DIRS = (Path("/run/containerd/s"), Path("/run/containerd"))

CONFIG = """version = 2
root = "{tmp}/root"
state = "{tmp}/state"
disabled_plugins = [
  "io.containerd.grpc.v1.cri",
  "io.containerd.internal.v1.opt",
  "io.containerd.internal.v1.tracing",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs",
]
[grpc]
  address = "{tmp}/c.sock"
[ttrpc]
  address = "{tmp}/c.sock.ttrpc"
"""


def available() -> str | None:
    """Why no containerd can be run here (None: it can)."""
    for tool in ("containerd", "ctr", "containerd-shim-runc-v2", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (.ci/setup installs the containerd package)"
    return None


@dataclass
class Containerd:
    tmp: Path
    proc: subprocess.Popen[bytes]
    started: list[tuple[str, str]] = field(default_factory=list)  # (namespace, id)

    @property
    def address(self) -> str:
        return str(self.tmp / "c.sock")

    def ctr(
        self, namespace: str, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ctr", "--address", self.address, "--namespace", namespace, *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def start(self, namespace: str, spec: Path, cid: str) -> int:
        """`ctr run -d` a container from the OCI spec at `spec`; its task's host pid."""
        self.started.append((namespace, cid))
        done = self.ctr(
            namespace,
            *("run", "-d", "--null-io", "--runc-root", str(self.tmp / "runc")),
            *("-c", str(spec), cid),
            check=False,
        )
        assert done.returncode == 0, done.stderr
        pid = self.task_pid(namespace, cid)
        assert pid is not None, self.ctr(namespace, "task", "ls", check=False).stdout
        return pid

    def task_pid(self, namespace: str, cid: str) -> int | None:
        """The host pid of the container's init (`ctr task ls`), None when it has no task."""
        for line in self.ctr(namespace, "task", "ls", check=False).stdout.splitlines()[1:]:
            words = line.split()
            if len(words) >= 3 and words[0] == cid and words[2] == "RUNNING":
                return int(words[1])
        return None

    def remove(self, namespace: str, cid: str) -> None:
        """Kill the container's task, delete it and the container (each step may find nothing)."""
        self.ctr(namespace, "task", "kill", "--signal", "SIGKILL", cid, check=False)
        wait_until(lambda: self.task_pid(namespace, cid) is None, 20, 0.1)

        def done(*args: str) -> bool:
            return self.ctr(namespace, *args, check=False).returncode == 0

        # The task's exit may reach containerd a moment after the kill.
        wait_until(lambda: done("task", "delete", cid), 10, 0.1)
        wait_until(lambda: done("container", "delete", cid), 10, 0.1)


def _shims(address: str) -> list[int]:
    """Pids of the runc v2 shims serving `address` (their command line names it)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
                if argv[0].endswith(b"containerd-shim-runc-v2") and address.encode() in argv:
                    out.append(int(name))
    return out


@contextlib.contextmanager
def private_containerd(tmp: Path) -> Iterator[Containerd]:
    tmp.mkdir(parents=True, exist_ok=True)
    made = [d for d in SHIM_DIRS if not d.exists()]
    (tmp / "config.toml").write_text(CONFIG.format(tmp=tmp))
    with open(tmp / "containerd.log", "wb") as out:
        proc = subprocess.Popen(
            ["containerd", "--config", str(tmp / "config.toml")],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    daemon = Containerd(tmp, proc)
    try:
        poll(
            lambda: (
                proc.poll() is not None
                or daemon.ctr("default", "version", check=False).returncode == 0
            ),
            30,
            0.1,
            what="containerd answers",
        )
        assert proc.poll() is None, (tmp / "containerd.log").read_text()[-4000:]
        yield daemon
    finally:
        for namespace, cid in reversed(daemon.started):
            daemon.remove(namespace, cid)
        for namespace in dict.fromkeys(ns for ns, _ in daemon.started):
            daemon.ctr(namespace, "namespace", "remove", namespace, check=False)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in _shims(daemon.address):  # a shim whose task could not be deleted
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for d in made:  # s/ before its parent
            with contextlib.suppress(OSError):
                d.rmdir()
