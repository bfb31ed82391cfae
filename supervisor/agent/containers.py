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
from supervisor.errors import SupervisorError
from supervisor.hostfs import HostFS
from supervisor.procfs.files import read_cmdline, read_environ
from supervisor.procfs.identity import ProcessId
from supervisor.procfs.stat import ProcStat, read_proc_stat
from supervisor.procfs.walk import host_pids
from supervisor.topology.accelerators import VISIBILITY_VARIABLES
from supervisor.topology.cgroup import cpuset_of, parse_proc_cgroup
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
    for line in ordered:
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
        }


@dataclass(slots=True)
class _Member:
    stat: ProcStat
    lines: tuple[CgroupLine, ...]


def _read_member(fs: HostFS, pid: int) -> _Member | None:
    text = fs.read_optional(f"proc/{pid}/cgroup")
    stat = read_proc_stat(fs, pid)
    if text is None or stat is None:
        return None  # gone meanwhile
    return _Member(stat, parse_proc_cgroup(text, f"proc/{pid}/cgroup"))


def _open_devices(fs: HostFS, pid: int) -> set[tuple[int, int]]:
    """(major, minor) of the character devices `pid` holds open (fds it may not show: none)."""
    try:
        names = fs.listdir(f"proc/{pid}/fd")
    except OSError:
        return set()
    out: set[tuple[int, int]] = set()
    for name in names:
        target = fs.readlink(f"proc/{pid}/fd/{name}")
        if target is not None and target.startswith("/dev/"):
            number = fs.char_device(f"proc/{pid}/fd/{name}")
            if number is not None:
                out.add(number)
    return out


def find_containers(
    fs: HostFS, *, extra_roots: Sequence[str] = (), pids: Iterable[int] | None = None
) -> list[Container]:
    """Every container with a process on this node, in cgroup-path order.

    A process that exits during the walk is passed over; one whose files cannot
    be read is skipped (the agent reports what it could not see by its count)."""
    groups: dict[str, tuple[ContainerRef, dict[int, _Member]]] = {}
    for pid in host_pids(fs) if pids is None else pids:
        try:
            member = _read_member(fs, pid)
        except (OSError, SupervisorError, ValueError):
            continue
        if member is None:
            continue
        ref = container_of_lines(member.lines, extra_roots)
        if ref is None:
            continue
        groups.setdefault(ref.cgroup, (ref, {}))[1][pid] = member
    numbers = read_char_devices(fs) if groups else {}
    found = [_container(fs, ref, members, numbers) for ref, members in groups.values()]
    return sorted((c for c in found if c is not None), key=lambda c: c.ref.cgroup)


def _container(
    fs: HostFS,
    ref: ContainerRef,
    members: Mapping[int, _Member],
    numbers: Mapping[tuple[int, int], str],
) -> Container | None:
    # Its first process: a parent outside the container; of several (a runtime
    # that exec'd two), the oldest.
    heads = [m.stat for m in members.values() if m.stat.ppid not in members]
    if not heads:
        return None
    head = min(heads, key=lambda s: (s.start_time, s.pid))
    command = read_cmdline(fs, head.pid)
    environ = read_environ(fs, head.pid, VISIBILITY_VARIABLES)
    if command is None or environ is None:
        return None  # exited during the walk
    member = members[head.pid]
    cpuset = cpuset_of(fs, member.lines)
    held: set[tuple[int, int]] = set()
    for pid in members:
        held |= _open_devices(fs, pid)
    devices = sorted({numbers[n] for n in held if n in numbers})
    return Container(
        ref,
        ProcessId(head.pid, head.start_time),
        (head.pid, *sorted(p for p in members if p != head.pid)),
        command,
        recognise_kind(command.split()),
        environ,
        None if cpuset is None else cpuset.cpus,
        None if cpuset is None else cpuset.mems,
        tuple(devices),
    )
