"""The kubelet's Pod Resources API: what each container was allotted (devices, exclusive CPUs).

`v1.PodResourcesLister/List` on the kubelet's socket
(/var/lib/kubelet/pod-resources/kubelet.sock, mounted into the agent's pod) answers,
per pod and container, the device plugins' device ids with their NUMA nodes and
the CPU manager's exclusive CPU ids (k8s.io/kubelet/pkg/apis/podresources/v1/
api.proto; `cpu_ids` and `topology` since Kubernetes 1.21). The answer names pods
by namespace and name, not uid: the agent matches them by the names the kubelet's
log tree gives (supervisor.agent.kube_names).

Device ids are the plugin's own: the NVIDIA plugin's are GPU UUIDs
("GPU-8f6c..."), matched to PCI addresses by the driver's information files;
plugins that name devices by PCI address (AMD's, SR-IOV's) are taken as they
are; any other id (MIG instances, Ascend's "Ascend910-3") is unresolved, and the
agent then reads the container's device nodes instead (supervisor.agent.reach).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from supervisor.agent.grpc_unix import GrpcError, unary_call
from supervisor.hostfs import HostFS
from supervisor.topology.device_minors import NVIDIA_GPUS
from supervisor.topology.devices import parse_nvidia_information
from supervisor.topology.pci import normalize_bdf

SOCKET = "var/lib/kubelet/pod-resources/kubelet.sock"  # under the host root
LIST = "/v1.PodResourcesLister/List"
TIMEOUT_S = 5.0


class ProtobufError(GrpcError):
    """An answer that is not a well-formed protobuf message."""


@dataclass(frozen=True, slots=True)
class Devices:
    resource: str  # "nvidia.com/gpu"
    ids: tuple[str, ...]
    numa_nodes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Allotted:
    """One container's resources as the kubelet allotted them."""

    namespace: str
    pod: str
    container: str
    devices: tuple[Devices, ...]
    cpu_ids: tuple[int, ...]  # exclusive CPUs (static CPU manager); () in the shared pool


# -- protobuf wire format (protobuf.dev/programming-guides/encoding) ------------------------


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise ProtobufError("a varint runs past the message")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
        if shift >= 70:
            raise ProtobufError("a varint over 10 bytes")


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field: an int for varints and fixed
    widths, bytes for length-delimited ones (messages, strings, packed lists)."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 1:
            value, i = int.from_bytes(data[i : i + 8], "little"), i + 8
        elif wire == 2:
            length, i = _varint(data, i)
            if i + length > len(data):
                raise ProtobufError(f"field {number} runs past the message")
            value, i = data[i : i + length], i + length
        elif wire == 5:
            value, i = int.from_bytes(data[i : i + 4], "little"), i + 4
        else:
            raise ProtobufError(f"field {number}: wire type {wire}")
        if i > len(data):
            raise ProtobufError(f"field {number} runs past the message")
        yield number, wire, value


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise ProtobufError("a string field that is not length-delimited")
    return value.decode("utf-8", "replace")


def _message(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise ProtobufError("a message field that is not length-delimited")
    return value


def _int64s(value: int | bytes) -> list[int]:
    """A repeated int64: one varint, or a packed run of them (proto3's default)."""
    if isinstance(value, int):
        return [_signed(value)]
    out, i = [], 0
    while i < len(value):
        v, i = _varint(value, i)
        out.append(_signed(v))
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# -- the messages -------------------------------------------------------------------------


def _topology(data: bytes) -> list[int]:
    """TopologyInfo { repeated NUMANode nodes = 1 }, NUMANode { int64 ID = 1 }."""
    nodes = []
    for number, _, value in fields(data):
        if number == 1:
            for n2, _, v2 in fields(_message(value)):
                if n2 == 1:
                    nodes += _int64s(v2)
    return nodes


def _devices(data: bytes) -> Devices:
    """ContainerDevices { resource_name = 1; repeated device_ids = 2; topology = 3 }."""
    resource, ids, nodes = "", [], []
    for number, _, value in fields(data):
        if number == 1:
            resource = _text(value)
        elif number == 2:
            ids.append(_text(value))
        elif number == 3:
            nodes += _topology(_message(value))
    return Devices(resource, tuple(ids), tuple(sorted(set(nodes))))


def parse_list_answer(data: bytes) -> list[Allotted]:
    """ListPodResourcesResponse { repeated PodResources pod_resources = 1 } (pure).
    Unknown fields (memory, dynamic resources, later additions) are skipped."""
    out: list[Allotted] = []
    for number, _, value in fields(data):
        if number != 1:
            continue
        name = namespace = ""
        containers: list[bytes] = []
        for n2, _, v2 in fields(_message(value)):
            if n2 == 1:
                name = _text(v2)
            elif n2 == 2:
                namespace = _text(v2)
            elif n2 == 3:
                containers.append(_message(v2))
        for c in containers:
            cname, devices, cpus = "", [], []
            for n3, _, v3 in fields(c):
                if n3 == 1:
                    cname = _text(v3)
                elif n3 == 2:
                    devices.append(_devices(_message(v3)))
                elif n3 == 3:
                    cpus += _int64s(v3)
            out.append(Allotted(namespace, name, cname, tuple(devices), tuple(sorted(cpus))))
    return out


async def list_pod_resources(socket_path: str, timeout_s: float = TIMEOUT_S) -> list[Allotted]:
    """Every container the kubelet lists; GrpcError names the socket and what failed."""
    return parse_list_answer(await unary_call(socket_path, LIST, b"", timeout_s))


# -- device ids to PCI addresses ------------------------------------------------------------


def nvidia_uuids(fs: HostFS) -> dict[str, str]:
    """{GPU UUID, lower case: PCI address} from the driver's information files."""
    out: dict[str, str] = {}
    for entry in fs.listdir(NVIDIA_GPUS):
        info = parse_nvidia_information(
            fs.read_optional(f"{NVIDIA_GPUS}/{entry}/information") or ""
        )
        if info.uuid:
            out[info.uuid.lower()] = entry.lower()
    return out


def allotted_pci(
    allotted: Allotted, uuids: Mapping[str, str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(PCI addresses, ids not resolved) of a container's device ids (pure)."""
    found: set[str] = set()
    unresolved: list[str] = []
    for group in allotted.devices:
        for device_id in group.ids:
            bdf = normalize_bdf(device_id) or uuids.get(device_id.lower())
            if bdf is None:
                unresolved.append(f"{group.resource}={device_id}")
            else:
                found.add(bdf)
    return tuple(sorted(found)), tuple(unresolved)
