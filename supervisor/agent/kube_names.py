"""Kubernetes names of this node's pods and containers, from the kubelet's log tree (reads only).

The cgroup path says a container's pod UID and container id, not its names; the
node agent reads the names the kubelet itself writes on every node, with no
Kubernetes API: per container a link `<logs>/containers/<pod>_<namespace>_<container>-<id>.log`
to `<pod logs>/<namespace>_<pod>_<pod UID>/<container>/<restart count>.log`, per pod a
directory `<logs>/pods/<namespace>_<pod>_<pod UID>` (kubernetes/kubernetes
pkg/kubelet/kuberuntime/legacy.go `legacyLogSymlink`/`logSymlink`, with
pkg/kubelet/container `BuildPodFullName` = name + "_" + namespace;
pkg/kubelet/kuberuntime/helpers.go `BuildPodLogsDirectory`,
`BuildContainerLogsDirectory`, `buildContainerLogsPath`). `_` is the separator
because no name may hold one: a pod name is a DNS subdomain, a namespace and a
container name DNS labels (lowercase letters, digits, `-`, and `.` in a pod name).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from supervisor.hostfs import HostFS

# logSymlink cuts the link's name to ext4's 255 bytes, ".log" included: a long pod
# name leaves only a prefix of the id, or none (then the pod's directory still names it).
_MAX_NAME = 255
_SUFFIX = ".log"
# The shortest id prefix taken from a cut name: what `container_id` shows (12 hex).
MIN_ID_PREFIX = 12

_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"  # DNS-1123 label: namespace, container
# DNS-1123 subdomain, a pod's name: 253 at most, and no limit per part (the
# apimachinery's IsDNS1123Subdomain checks the whole length only).
_PART = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = rf"{_PART}(?:\.{_PART})*"
_UID = r"[0-9a-f][-0-9a-f]{7,63}"  # an apiserver UUID, or a static pod's hash (hex)
_POD_DIR = re.compile(rf"(?P<namespace>{_LABEL})_(?P<pod>{_SUBDOMAIN})_(?P<uid>{_UID})")
_LINK = re.compile(rf"(?P<pod>{_SUBDOMAIN})_(?P<namespace>{_LABEL})_(?P<container>{_LABEL})-")
_ID = re.compile(r"[0-9a-f]+")
_LOG_FILE = re.compile(r"[0-9]+\.log")


@dataclass(frozen=True, slots=True)
class PodName:
    namespace: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class ContainerName:
    pod: PodName
    container: str
    container_id: str  # as the link names it: the whole id, or a prefix of a cut name
    cut: bool = False  # the link's name was cut at 255 bytes: `container_id` is a prefix


@dataclass(frozen=True, slots=True)
class KubeNames:
    """What the kubelet's log tree names, by pod UID and by container id."""

    pods: Mapping[str, PodName] = field(default_factory=dict)  # by UID
    containers: Mapping[str, ContainerName] = field(default_factory=dict)  # by id (or prefix)
    problems: tuple[str, ...] = ()  # one line per entry that is no kubelet name

    def pod(self, uid: str) -> PodName | None:
        return self.pods.get(uid)

    def container(self, pod_uid: str, container_id: str) -> ContainerName | None:
        """The names of the container `container_id` of pod `pod_uid`; a link whose
        pod UID is another's is not this container's (pure)."""
        found = self.containers.get(container_id)
        if found is None:
            cut = [
                c
                for c in self.containers.values()
                if c.cut and container_id.startswith(c.container_id)
            ]
            found = cut[0] if len(cut) == 1 else None
        return found if found is not None and found.pod.uid == pod_uid else None


def parse_pod_dir(name: str) -> PodName | None:
    """`<namespace>_<pod>_<uid>` (a pod's log directory) as a PodName, else None (pure)."""
    m = _POD_DIR.fullmatch(name)
    if m is None or len(m.group("pod")) > 253:
        return None
    return PodName(m.group("namespace"), m.group("pod"), m.group("uid"))


def parse_container_link(name: str, target: str) -> ContainerName | str:
    """A link under containers/ (its name and target, as written) as a ContainerName,
    or what is wrong with it (pure). The names must agree between the two: the
    target's directory gives the pod UID, the name the container id."""
    if not name.endswith(_SUFFIX):
        return f"name {name!r} does not end in {_SUFFIX}"
    stem = name[: -len(_SUFFIX)]
    m = _LINK.match(stem)
    if m is None:
        return f"name {name!r} is not <pod>_<namespace>_<container>-<id>.log"
    cid = stem[m.end() :]
    cut = len(name) >= _MAX_NAME
    if not _ID.fullmatch(cid) or (cut and len(cid) < MIN_ID_PREFIX):
        return f"name {name!r}: container id {cid!r} is not hex" + (
            f" of {MIN_ID_PREFIX} digits or more (the name was cut at {_MAX_NAME} bytes)"
            if cut
            else ""
        )
    parts = target.rstrip("/").split("/")
    if len(parts) < 3 or _LOG_FILE.fullmatch(parts[-1]) is None:
        return f"target {target!r} is not <pod logs>/<namespace>_<pod>_<uid>/<container>/<n>.log"
    pod = parse_pod_dir(parts[-3])
    if pod is None:
        return f"target {target!r}: {parts[-3]!r} is not <namespace>_<pod>_<uid>"
    names = (m.group("namespace"), m.group("pod"), m.group("container"))
    if names != (pod.namespace, pod.name, parts[-2]):
        return f"name {name!r} and target {target!r} name another pod or container"
    return ContainerName(pod, parts[-2], cid, cut)


def read_kube_names(fs: HostFS, logs_dir: str) -> KubeNames | None:
    """The names under `logs_dir` (relative to `fs`'s root; the kubelet's is /var/log);
    None when it has neither containers/ nor pods/: not a Kubernetes node, or the
    directory is not mounted. A link's target is only read, never followed: in a
    DaemonSet the host's /var/log/pods may be mounted elsewhere, or not at all."""
    base = logs_dir.strip("/")
    containers_dir = f"{base}/containers" if base else "containers"
    pods_dir = f"{base}/pods" if base else "pods"
    if not fs.is_dir(containers_dir) and not fs.is_dir(pods_dir):
        return None
    problems: list[str] = []
    pods: dict[str, PodName] = {}
    for entry in fs.listdir(pods_dir):  # [] when missing or unreadable: names unknown
        pod = parse_pod_dir(entry)
        # A kubelet before 1.14 named the directory by the UID alone: no names in it.
        if pod is not None:
            pods[pod.uid] = pod
        elif not re.fullmatch(_UID, entry):
            problems.append(f"{fs.path(pods_dir)}/{entry}: not <namespace>_<pod>_<uid>")
    containers: dict[str, ContainerName] = {}
    for entry in fs.listdir(containers_dir):
        target = fs.readlink(f"{containers_dir}/{entry}")
        if target is None:
            problems.append(f"{fs.path(containers_dir)}/{entry}: not a symbolic link")
            continue
        got = parse_container_link(entry, target)
        if isinstance(got, str):
            problems.append(f"{fs.path(containers_dir)}/{entry}: {got}")
            continue
        containers[got.container_id] = got
        pods.setdefault(got.pod.uid, got.pod)
    return KubeNames(pods, containers, tuple(problems))
