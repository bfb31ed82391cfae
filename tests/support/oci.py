"""OCI bundles for real `runc` containers of the daemon (tests only; does I/O: runc, files).

`make_bundle` starts from `runc spec` and edits it: the root is an empty dir
with bind mounts of this host's /usr, /lib*, /bin, /sbin, /etc, the Python
install the venv's python resolves to, the checkout (with its .venv) and the
test's own dirs; the host's network namespace is kept (the test talks to the
API on 127.0.0.1) and the container gets its own pid namespace, so the daemon
is its PID 1. The unprivileged profile is what docker gives by default (its default
capabilities, a read-only /sys and cgroupfs, /proc/irq read-only) plus the
seccomp rules its default profile applies without CAP_SYS_NICE; the
privileged one is `docker run --privileged` (every capability, /sys and
cgroupfs read-write, no masked paths, no seccomp).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.daemon_support import (
    REPO,
)
from tests.support.poll import poll

# capabilities(7) numbers of docker's default set (moby oci/caps/defaults.go):
# no CAP_SYS_ADMIN, no CAP_SYS_NICE, no CAP_SYS_RESOURCE.
DOCKER_DEFAULT_CAPS = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_NET_RAW": 13,
    "CAP_SYS_CHROOT": 18,
    "CAP_MKNOD": 27,
    "CAP_AUDIT_WRITE": 29,
    "CAP_SETFCAP": 31,
}
# Every capability (capabilities(7), in bit order): what `docker run --privileged` grants.
ALL_CAPS = (
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
)
# What docker's default seccomp profile fails with EPERM unless CAP_SYS_NICE is held.
MEMPOLICY_SYSCALLS = ("mbind", "set_mempolicy", "migrate_pages", "move_pages")


@dataclass(frozen=True, slots=True)
class Profile:
    """How much the runtime allows the container."""

    privileged: bool

    def caps(self) -> list[str]:
        wanted = dict(DOCKER_DEFAULT_CAPS)
        if self.privileged:
            wanted = {f"CAP_{name}": bit for bit, name in enumerate(ALL_CAPS)}
        return [name for name, bit in wanted.items() if held_bounding() >> bit & 1]


def held_bounding() -> int:
    """This process's bounding set: runc can grant nothing beyond it."""
    status = Path("/proc/self/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("CapBnd")), 16)


def runc(*args: str, check: bool = True, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runc", *args], capture_output=True, text=True, check=check, timeout=timeout_s
    )


def daemon_process(config: Path, cid: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The daemon's argv and environment inside a container of id `cid`: this
    venv's interpreter (bind-mounted at the same path), the API on `port`."""
    venv_bin = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "PYTHONUNBUFFERED": "1",
        "PLACEMENT_SUPERVISOR_INSTANCE": cid,
        "HOME": "/tmp",
    }
    args = [sys.executable, "-m", "supervisor", "run", "--config", str(config)]
    return [*args, "--listen", f"127.0.0.1:{port}"], env


def make_bundle(
    bundle: Path,
    args: Sequence[str],
    env: dict[str, str],
    *,
    cgroups_path: str,
    cpus: str,
    profile: Profile,
    binds: Sequence[str] = (),
    devices: Sequence[tuple[str, int, int]] = (),
) -> dict[str, Any]:
    """Write `bundle`/config.json (and an empty rootfs); returns the spec.
    `devices`: (path, major, minor) character devices runc makes in the
    container's own /dev (its tmpfs: the host's /dev is not touched)."""
    rootfs = bundle / "rootfs"
    rootfs.mkdir(parents=True)
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, timeout=30)
    spec: dict[str, Any] = json.loads((bundle / "config.json").read_text())
    spec["root"] = {"path": str(rootfs), "readonly": False}
    proc = spec["process"]
    proc.update(terminal=False, args=list(args), cwd=str(REPO))
    proc["env"] = [f"{k}={v}" for k, v in env.items()]
    caps = profile.caps()
    proc["capabilities"] = {k: caps for k in ("bounding", "effective", "permitted")}
    proc.pop("rlimits", None)  # the host's: the daemon raises its fd limit itself
    python_home = Path(sys.executable).resolve().parent.parent  # .venv/bin/python -> pyenv
    paths = ["/usr", "/bin", "/sbin", "/etc", str(REPO), str(python_home), *binds]
    paths += [p for p in ("/lib", "/lib32", "/lib64", "/libx32") if os.path.isdir(p)]
    mounts = spec["mounts"]
    for m in mounts:
        if m["destination"] in ("/sys", "/sys/fs/cgroup"):
            # runc spec's own `cgroup` mount: each hierarchy with the container's
            # cgroup as its root (no cgroup namespace), as docker mounts it on v1.
            opts = [o for o in m.get("options", []) if o not in ("ro", "rw")]
            m["options"] = [*opts, "rw" if profile.privileged else "ro"]
    for path in dict.fromkeys(paths):
        mounts.append({"destination": path, "type": "bind", "source": path, "options": ["rbind"]})
    linux = spec["linux"]
    # Host network (the API on 127.0.0.1); the pid namespace stays: the daemon is PID 1.
    linux["namespaces"] = [n for n in linux["namespaces"] if n["type"] != "network"]
    linux["cgroupsPath"] = cgroups_path
    linux["resources"] = {"cpu": {"cpus": cpus, "mems": "0"}}
    linux["devices"] = [
        {"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 0o666}
        for path, major, minor in devices
    ]
    if devices:
        # The device cgroup's rule for them (runc allows only its defaults).
        linux["resources"]["devices"] = [
            {"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"}
            for _, major, minor in devices
        ]
    if profile.privileged:
        linux.pop("maskedPaths", None)
        linux.pop("readonlyPaths", None)
    else:
        linux["seccomp"] = {
            "defaultAction": "SCMP_ACT_ALLOW",
            "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"],
            "syscalls": [
                {"names": list(MEMPOLICY_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": 1}
            ],
        }
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))
    return spec


def state(cid: str) -> str:
    """The container's status ("running", "stopped"), or "gone" once deleted."""
    done = runc("state", cid, check=False)
    return json.loads(done.stdout)["status"] if done.returncode == 0 else "gone"


def init_pid(cid: str) -> int | None:
    """The host pid of the container's PID 1 (`runc state`), None once it is gone."""
    done = runc("state", cid, check=False)
    pid = int(json.loads(done.stdout).get("pid") or 0) if done.returncode == 0 else 0
    return pid or None


def host_pids(cid: str) -> list[int]:
    """The container's processes, as this (the host's) pid namespace numbers them."""
    done = runc("ps", "--format", "json", cid, check=False)
    return list(json.loads(done.stdout or "[]") or []) if done.returncode == 0 else []


def container_pid(host_pid: int) -> int | None:
    """The pid `host_pid` has in its own (innermost) pid namespace (NSpid, proc(5))."""
    try:
        status = Path(f"/proc/{host_pid}/status").read_text()
    except OSError:
        return None
    line = next((ln for ln in status.splitlines() if ln.startswith("NSpid:")), None)
    return None if line is None else int(line.split()[-1])


@contextlib.contextmanager
def running(bundle: Path, cid: str, log: Path) -> Iterator[None]:
    """`runc run -d` the bundle; killed and deleted afterwards, whatever happened."""
    with open(log, "wb") as out:
        started = subprocess.run(
            ["runc", "run", "-d", "--bundle", str(bundle), cid],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            timeout=60,
            check=False,
        )
    assert started.returncode == 0, log.read_text()
    try:
        yield
    finally:
        runc("kill", cid, "KILL", check=False)
        poll(lambda: state(cid) in ("stopped", "gone"), 20, what=f"container {cid} stopped")
        runc("delete", "--force", cid, check=False)


def remove_cgroup_tree(top: Path, timeout_s: float = 20.0) -> None:
    """rmdir `top` and every cgroup dir below it, deepest first. A dir whose last
    tasks are still leaving (a killed container's, reaped a moment later on a busy
    machine) is retried until `timeout_s`; one that still has a child dir of
    someone else's is left."""
    if not top.is_dir():
        return
    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        _rmdir_when_empty(d, timeout_s)
    _rmdir_when_empty(top, timeout_s)


def _rmdir_when_empty(d: Path, timeout_s: float) -> None:
    def removed() -> bool:
        try:
            d.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            # Busy: its last tasks are leaving (wait), or another pod's or container's
            # dir is below it (not ours to wait for).
            return any(p.is_dir() for p in d.iterdir())
        return True

    poll(removed, timeout_s, interval_s=0.05, what=f"{d} emptied and removed")


@contextlib.contextmanager
def kubelet_parents(pod: str) -> Iterator[None]:
    """The kubelet's cgroupfs parents (`/kubepods/besteffort/pod<UID>`) of a test's
    containers, on a host with no kubelet: runc makes them with the container's own
    cgroup and removes only its own, so on exit the pod's dirs are removed, and
    `/kubepods` in each hierarchy that had none before."""
    hierarchies = [h for h in Path("/sys/fs/cgroup").iterdir() if h.is_dir()]
    ours = [h for h in hierarchies if not (h / "kubepods").exists()]
    try:
        yield
    finally:
        for hierarchy in hierarchies:
            remove_cgroup_tree(hierarchy / "kubepods" / "besteffort" / f"pod{pod}")
        for hierarchy in ours:
            remove_cgroup_tree(hierarchy / "kubepods")
