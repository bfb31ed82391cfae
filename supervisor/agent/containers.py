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

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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


# /proc/<pid>/cgroup text -> its lines (host paths) and container: the processes
# of a container, and most of a host's services, share one text, and parsing it
# was two thirds of a look at the node (a v1 host's text has a dozen lines).
CgroupMemo = dict[str, tuple[tuple[CgroupLine, ...], "ContainerRef | None"]]
MEMO_MAX = 4096  # distinct texts kept; past it the memo starts again
CGROUP_FILE_MAX = 1 << 16
CLK_TCK = os.sysconf("SC_CLK_TCK")
# A process is read again at every look until it is this old: a runtime starts a
# container's first process in its own cgroup and moves it in just before the
# exec (runc's init writes its pid to cgroup.procs), so a young process's cgroup
# is not yet settled. An older one keeps the container (or none) it was seen in.
SETTLED_S = 10.0
# Every this many looks, every process is read again whatever its age (a process
# an operator moved between cgroups; a pid reused between two looks).
FULL_LOOK_EVERY = 30


@dataclass(slots=True)
class LookCache:
    """What one look at the node leaves for the next (mutable; one per agent).

    A settled process (older than SETTLED_S) keeps what its last read found:
    the next look reads only the processes new since (and the young ones), not
    every /proc/<pid>/cgroup of the node (each container's main process's
    command line and environment are read at every look: it may exec). Every
    FULL_LOOK_EVERY looks, and whenever the namespace roots are found again,
    everything is read anew."""

    memo: CgroupMemo = field(default_factory=dict)
    # pid -> (its container and stat, or None: in none), for settled processes
    seen: dict[int, tuple[ContainerRef, _Member] | None] = field(default_factory=dict)
    roots: object = None  # the namespace roots the rest was read with
    looks: int = 0
    reads: int = 0  # /proc/<pid>/cgroup reads, for tests
    settled_s: float = SETTLED_S
    full_every: int = FULL_LOOK_EVERY

    def begin(self, roots: object) -> None:
        """Start a look: everything is read anew at every `full_every`-th and
        whenever the namespace roots changed."""
        full = roots != self.roots or self.looks % self.full_every == 0
        self.looks += 1
        if full or len(self.memo) > MEMO_MAX:
            self.memo.clear()
        if full:
            self.seen.clear()
            self.roots = roots


def _read_member(
    fs: HostFS,
    pid: int,
    ns_roots: Mapping[Hierarchy, NamespaceRoot],
    extra_roots: Sequence[str],
    *,
    cache: LookCache,
    settled_before: int | None,
) -> tuple[ContainerRef, _Member] | None:
    """`pid`'s container and its files; None when it is in none, or gone.

    Its stat is read only once its cgroup names a container, or where the cache
    keeps it (`settled_before`, in clock ticks since boot: started before this, it
    is settled): most of a node's processes are in none."""
    # One read: the file is a single_open seq_file, whole in one read of this size.
    raw = fs.read_live(f"proc/{pid}/cgroup", CGROUP_FILE_MAX, f"pid {pid}")
    cache.reads += 1
    if raw is None:
        return None  # gone meanwhile
    text = raw.decode(errors="replace")
    known = cache.memo.get(text)
    if known is None:
        lines = resolve_lines(parse_proc_cgroup(text, f"proc/{pid}/cgroup"), ns_roots)
        known = cache.memo[text] = (lines, container_of_lines(lines, extra_roots))
    lines, ref = known
    if ref is None and settled_before is None:
        return None
    stat = read_proc_stat(fs, pid, main_thread=True)
    if stat is None:
        return None
    got = None if ref is None else (ref, _Member(stat, lines))
    if settled_before is not None and stat.start_time < settled_before:
        cache.seen[pid] = got
    return got


def _settled_before(fs: HostFS, settled_s: float) -> int | None:
    """The start time (clock ticks since boot, /proc/<pid>/stat field 22) before
    which a process is settled now (/proc/uptime); None where it cannot be read."""
    text = fs.read_optional("proc/uptime")
    try:
        uptime = float(text.split()[0]) if text else None
    except (ValueError, IndexError):
        uptime = None
    return None if uptime is None else int((uptime - settled_s) * CLK_TCK)


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
    cache: LookCache | None = None,
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
    does not use them. `cache`: what the last look with the same `extra_roots`
    found (a caller that looks again keeps one: LookCache); filled here."""
    if ns_roots is None:
        ns_roots = find_namespace_roots(fs)
    keep = cache is not None
    cache = LookCache() if cache is None else cache
    cache.begin(ns_roots)
    settled_before = _settled_before(fs, cache.settled_s) if keep else None
    groups: dict[str, tuple[ContainerRef, dict[int, _Member]]] = {}
    listed = host_pids(fs) if pids is None else list(pids)
    for pid in listed:
        if pid in cache.seen:
            got = cache.seen[pid]
        else:
            try:
                got = _read_member(
                    fs, pid, ns_roots, extra_roots, cache=cache, settled_before=settled_before
                )
            except (OSError, SupervisorError, ValueError):
                continue
        if got is None:
            continue
        ref, member = got
        groups.setdefault(ref.cgroup, (ref, {}))[1][pid] = member
    if keep and len(cache.seen) > len(listed):  # forget the gone
        present = set(listed)
        cache.seen = {pid: got for pid, got in cache.seen.items() if pid in present}
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


def _head_facts(fs: HostFS, pid: int) -> tuple[str, dict[str, str], tuple[str, ...]] | None:
    """A main process's command line, visibility variables and what of them the
    kernel refused; None when it exited."""
    # cmdline is readable by anyone (proc(5)); environ needs ptrace access to the
    # process (CAP_SYS_PTRACE for another user's): without it the container is
    # still listed, with its visibility variables unknown.
    command = read_cmdline(fs, pid)
    if command is None:
        return None
    refused: tuple[str, ...] = ()
    try:
        environ = read_environ(fs, pid, VISIBILITY_VARIABLES)
    except KernelError as err:
        if isinstance(err, Gone):
            raise
        environ, refused = {}, (_denied(f"environ of pid {pid}", err),)
    return None if environ is None else (command, environ, refused)


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
    # fd/ needs ptrace access as environ does (_head_facts): without it the
    # container is listed with its devices unknown.
    main = ProcessId(head.pid, head.start_time)
    # Read at every look: a main process may exec (a launcher script into the engine).
    facts = _head_facts(fs, head.pid)
    if facts is None:
        return None  # exited during the walk
    command, environ, refused_env = facts
    reasons = list(refused_env)
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
        main,
        (head.pid, *sorted(p for p in members if p != head.pid)),
        command,
        recognise_kind(command.split()),
        environ,
        None if cpuset is None else cpuset.cpus,
        None if cpuset is None else cpuset.mems,
        tuple(pcis),
        "; ".join(reasons) or None,
    )
