"""The containers on this node, found from /proc and the cgroup tree alone (reads only).

A node agent places engines in containers it did not start (issue 31): it must
find them without a runtime's API. Every process of a container shares one
cgroup path, and each runtime names that path after the container:

- the kubelet with the cgroupfs driver (v1 and v2):
  `/kubepods[/burstable|/besteffort]/pod<UID>/<CONTAINER-ID>`;
- the kubelet with the systemd driver:
  `/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<UID, _ for ->.slice/`
  `<cri-containerd|crio|docker>-<CONTAINER-ID>.scope`;
- Docker, containerd and Podman outside Kubernetes: `/system.slice/docker-<ID>.scope`,
  `/docker/<ID>`, `/machine.slice/libpod-<ID>.scope`, `/libpod_parent/libpod-<ID>`.

The paths are those the kubelet's cgroup manager builds
(pkg/kubelet/cm/cgroup_manager_linux.go, `ToSystemd` and `escapeSystemdCgroupName`,
pod names `pod` + UID, QoS parents `burstable` and `besteffort`) and the
runtimes' scope names (containerd's `cri-containerd-`, CRI-O's `crio-`, moby's
`docker-`). A process deeper than the container's cgroup (a cgroup the
container made below its own, with a cgroup namespace) belongs to the
container whose name is on its path. `extra_roots` adds paths an operator's
runtime uses (a `runc run` with its own cgroupsPath): each cgroup directly
below one is a container named after its last component.

Per container: its processes, its main process (the one whose parent is
outside it: the container's init, or the runtime's shim child), that
process's command line and the engine kind it names
(supervisor.engines.engine_kind), the visibility variables of its
environment, the CPUs and memory nodes its cgroup allows (as this process's
mount namespace shows the cgroup tree: a DaemonSet mounts the host's), and
the accelerators its processes hold open, by device number
(supervisor.topology.device_minors: a container may see /dev/nvidia3 as
/dev/nvidia0).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from supervisor.engines.engine_kind import ResolvedKind, recognise_kind
from supervisor.errors import Gone, KernelError, SupervisorError
from supervisor.hostfs import HostFS
from supervisor.procfs.files import read_cmdline, read_environ
from supervisor.procfs.identity import ProcessId
from supervisor.procfs.stat import ProcStat, read_proc_stat
from supervisor.procfs.walk import host_pids
from supervisor.topology.accelerators import VISIBILITY_VARIABLES
from supervisor.topology.cgroup import cpuset_of, parse_proc_cgroup
from supervisor.topology.cgroupns import (
    Hierarchy,
    NamespaceRoot,
    find_namespace_roots,
    resolve_lines,
)
from supervisor.topology.device_minors import read_char_devices
from supervisor.topology.model import CgroupLine

# The pod's UID: the kubelet writes it with "-" (cgroupfs) or "_" (systemd).
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_ID = r"[0-9a-f]{12,64}"
_QOS = r"(?:burstable|besteffort)"
# (layout, pattern): the pattern matches the container's own cgroup from the
# start of the path; groups "pod", "qos" and "id".
_LAYOUTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "kubelet-cgroupfs",
        re.compile(rf"^/kubepods(?:/(?P<qos>{_QOS}))?/pod(?P<pod>{_UID})/(?P<id>{_ID})(?=/|$)"),
    ),
    (
        "kubelet-systemd",
        re.compile(
            rf"^/kubepods\.slice(?:/kubepods-(?P<qos>{_QOS})\.slice)?"
            rf"/kubepods(?:-{_QOS})?-pod(?P<pod>{_UID})\.slice"
            rf"/(?:cri-containerd|crio|docker)-(?P<id>{_ID})\.scope(?=/|$)"
        ),
    ),
    ("docker-systemd", re.compile(rf"^/system\.slice/docker-(?P<id>{_ID})\.scope(?=/|$)")),
    ("docker-cgroupfs", re.compile(rf"^/docker/(?P<id>{_ID})(?=/|$)")),
    ("podman", re.compile(rf"^/machine\.slice/libpod-(?P<id>{_ID})\.scope(?=/|$)")),
    ("podman-cgroupfs", re.compile(rf"^/libpod_parent/libpod-(?P<id>{_ID})(?=/|$)")),
)


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """Which container a cgroup path is: the part of the path that is the
    container's own cgroup and the names the runtime gave it."""

    cgroup: str  # the container's cgroup path (a process may sit below it)
    container_id: str
    layout: str  # one of _LAYOUTS' names, or "extra" (under an operator's root)
    pod_uid: str | None = None  # Kubernetes only, with "-" whatever the driver
    qos: str | None = None  # "burstable", "besteffort"; None: guaranteed (or no pod)


def container_of(path: str, extra_roots: Sequence[str] = ()) -> ContainerRef | None:
    """The container whose cgroup is `path` or holds it (pure); None for a
    process in no container (a host service, a session, the root cgroup)."""
    for layout, pattern in _LAYOUTS:
        m = pattern.match(path)
        if m is not None:
            pod = m.groupdict().get("pod")
            return ContainerRef(
                m.group(0),
                m.group("id"),
                layout,
                None if pod is None else pod.replace("_", "-"),
                m.groupdict().get("qos"),
            )
    for root in extra_roots:
        base = "/" + root.strip("/")
        if path.startswith(base + "/"):
            name = path[len(base) + 1 :].split("/", 1)[0]
            return ContainerRef(f"{base}/{name}", name, "extra")
    return None


def container_of_lines(
    lines: Sequence[CgroupLine], extra_roots: Sequence[str] = ()
) -> ContainerRef | None:
    """The container a process is in, from its /proc/<pid>/cgroup (pure): the
    first line whose path names one, cgroup2's first, then the v1 cpuset
    hierarchy's, then the rest (the kubelet and runc make the same path in each
    hierarchy; a hybrid host's runtime may leave the cgroup2 line at its parent's)."""
    ordered = sorted(
        lines, key=lambda ln: 0 if not ln.controllers else 1 if "cpuset" in ln.controllers else 2
    )
    tried: set[str] = set()
    for line in ordered:
        # A v1 host names the same path in most of its hierarchies: each is tried
        # once (the agent's walk does this for every process on the node).
        if line.path in tried:
            continue
        tried.add(line.path)
        ref = container_of(line.path, extra_roots)
        if ref is not None:
            return ref
    return None


@dataclass(frozen=True, slots=True)
class Container:
    """One container as the node shows it now."""

    ref: ContainerRef
    main: ProcessId  # its first process: the one whose parent is outside it
    pids: tuple[int, ...]  # every process in it, main first
    command: str  # main's command line, words joined by single spaces
    kind: ResolvedKind  # the engine kind main's command line names
    visible: Mapping[str, str]  # main's visibility variables (CUDA_VISIBLE_DEVICES, ...)
    cpus: frozenset[int] | None  # its cgroup's effective CPUs; None: unreadable
    mems: frozenset[int] | None
    devices: tuple[str, ...]  # PCI addresses of the accelerators its processes hold open
    # What could not be read (its main process's environ, some fds), when anything;
    # the rest is listed as read.
    reason: str | None = None

    def to_doc(self) -> dict[str, object]:
        from supervisor.cpulist import format_cpulist  # noqa: PLC0415 - for the document only

        return {
            "container_id": self.ref.container_id,
            "cgroup": self.ref.cgroup,
            "layout": self.ref.layout,
            "pod_uid": self.ref.pod_uid,
            "qos": self.ref.qos,
            "pid": self.main.pid,
            "start_time": self.main.start_time,
            "pids": list(self.pids),
            "command": self.command,
            "kind": self.kind,
            "visible": dict(self.visible),
            "cpus": None if self.cpus is None else format_cpulist(self.cpus),
            "mems": None if self.mems is None else format_cpulist(self.mems),
            "devices": list(self.devices),
            "reason": self.reason,
        }


@dataclass(slots=True)
class _Member:
    stat: ProcStat
    lines: tuple[CgroupLine, ...]


def _read_member(
    fs: HostFS,
    pid: int,
    ns_roots: Mapping[Hierarchy, NamespaceRoot],
    extra_roots: Sequence[str],
) -> tuple[ContainerRef, _Member] | None:
    """`pid`'s container and its files; None when it is in none, or gone.

    Its stat is read only once its cgroup names a container: most of a node's
    processes are in none, and the walk reads this for every one of them."""
    text = fs.read_optional(f"proc/{pid}/cgroup")
    if text is None:
        return None  # gone meanwhile
    lines = resolve_lines(parse_proc_cgroup(text, f"proc/{pid}/cgroup"), ns_roots)
    ref = container_of_lines(lines, extra_roots)
    if ref is None:
        return None
    stat = read_proc_stat(fs, pid)
    return None if stat is None else (ref, _Member(stat, lines))


def _open_devices(fs: HostFS, pid: int) -> set[tuple[int, int]]:
    """(major, minor) of the character devices `pid` holds open; an OSError when its
    fd directory cannot be listed (EACCES without CAP_SYS_PTRACE; gone: ENOENT)."""
    names = fs.listdir_or_raise(f"proc/{pid}/fd")
    out: set[tuple[int, int]] = set()
    for name in names:
        target = fs.readlink(f"proc/{pid}/fd/{name}")
        if target is not None and target.startswith("/dev/"):
            number = fs.char_device(f"proc/{pid}/fd/{name}")
            if number is not None:
                out.add(number)
    return out


def find_containers(
    fs: HostFS,
    *,
    extra_roots: Sequence[str] = (),
    pids: Iterable[int] | None = None,
    ns_roots: Mapping[Hierarchy, NamespaceRoot] | None = None,
    devices: bool = True,
) -> list[Container]:
    """Every container with a process on this node, in cgroup-path order.

    `ns_roots`: this process's cgroup namespace roots on the host
    (supervisor.topology.cgroupns; found here when not given), to read paths that
    /proc shows relative to them. A process that exits during the walk is passed
    over, as is a container whose processes all went; one whose main process's
    environ or fds cannot be read is listed with what was read and a `reason`.
    `devices=False` leaves each container's `devices` empty, its fds unread: the
    open files of every process are the walk's largest part after
    /proc/<pid>/cgroup, and the node agent, which walks every `--interval-s`,
    does not use them."""
    if ns_roots is None:
        ns_roots = find_namespace_roots(fs)
    groups: dict[str, tuple[ContainerRef, dict[int, _Member]]] = {}
    for pid in host_pids(fs) if pids is None else pids:
        try:
            got = _read_member(fs, pid, ns_roots, extra_roots)
        except (OSError, SupervisorError, ValueError):
            continue
        if got is None:
            continue
        ref, member = got
        groups.setdefault(ref.cgroup, (ref, {}))[1][pid] = member
    numbers = read_char_devices(fs) if groups and devices else {}
    found = []
    for ref, members in groups.values():
        try:
            found.append(_container(fs, ref, members, numbers, devices))
        except (OSError, SupervisorError):
            # Gone during the read (ESRCH, ENOENT), or a file of it garbled: this
            # one is left out of this pass, never the whole node.
            continue
    return sorted((c for c in found if c is not None), key=lambda c: c.ref.cgroup)


def _denied(what: str, err: OSError | KernelError) -> str:
    """One reason for a file the kernel refused ("environ of pid 4242: EACCES ...")."""
    text = str(err) if isinstance(err, KernelError) else f"{err.strerror or err}"
    return f"{what}: {text}"


def _container(
    fs: HostFS,
    ref: ContainerRef,
    members: Mapping[int, _Member],
    numbers: Mapping[tuple[int, int], str],
    devices: bool,
) -> Container | None:
    # Its first process: a parent outside the container; of several (a runtime
    # that exec'd two), the oldest.
    heads = [m.stat for m in members.values() if m.stat.ppid not in members]
    if not heads:
        return None
    head = min(heads, key=lambda s: (s.start_time, s.pid))
    # cmdline is readable by anyone (proc(5)); environ and fd/ need ptrace access
    # to the process (CAP_SYS_PTRACE for another user's): without it the
    # container is still listed, with its visibility variables and devices unknown.
    reasons: list[str] = []
    command = read_cmdline(fs, head.pid)
    if command is None:
        return None  # exited during the walk
    try:
        environ = read_environ(fs, head.pid, VISIBILITY_VARIABLES)
    except KernelError as err:
        if isinstance(err, Gone):
            raise
        environ = {}
        reasons.append(_denied(f"environ of pid {head.pid}", err))
    if environ is None:
        return None  # exited during the walk
    member = members[head.pid]
    cpuset = cpuset_of(fs, member.lines)
    held: set[tuple[int, int]] = set()
    refused: list[int] = []
    last: OSError | None = None
    for pid in members if devices else ():
        try:
            held |= _open_devices(fs, pid)
        except FileNotFoundError:
            continue  # this one exited: its devices are closed
        except OSError as err:
            refused.append(pid)
            last = err
    if refused and last is not None:
        pids = ",".join(str(p) for p in refused)
        reasons.append(_denied(f"fds of pid {pids} (devices unknown)", last))
    pcis = sorted({numbers[n] for n in held if n in numbers})
    return Container(
        ref,
        ProcessId(head.pid, head.start_time),
        (head.pid, *sorted(p for p in members if p != head.pid)),
        command,
        recognise_kind(command.split()),
        environ,
        None if cpuset is None else cpuset.cpus,
        None if cpuset is None else cpuset.mems,
        tuple(pcis),
        "; ".join(reasons) or None,
    )
