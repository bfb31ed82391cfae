"""The kubelet as the node agent's tests meet it: its log tree's links (the pods'
and containers' names) and its Pod Resources API, served by a real gRPC server
(grpcio) on a unix socket with messages the protobuf runtime encodes from the v1
schema (k8s.io/kubelet/pkg/apis/podresources/v1/api.proto, written out below as
a descriptor)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from supervisor.agent.pod_resources import LIST


def kubelet_link(logs: Path, pod: str, ns: str, uid: str, *, container: str, cid: str) -> None:
    """The link the kubelet makes under /var/log/containers (legacyLogSymlink)."""
    (logs / "containers").mkdir(parents=True, exist_ok=True)
    target = f"/var/log/pods/{ns}_{pod}_{uid}/{container}/0.log"
    (logs / "containers" / f"{pod}_{ns}_{container}-{cid}.log").symlink_to(target)


F = descriptor_pb2.FieldDescriptorProto
REPEATED, OPTIONAL = F.LABEL_REPEATED, F.LABEL_OPTIONAL

# The v1 schema (Kubernetes 1.28+): message -> [(field, number, type, label, message type)].
SCHEMA: dict[str, list[tuple[str, int, int, int, str]]] = {
    "ListPodResourcesResponse": [("pod_resources", 1, F.TYPE_MESSAGE, REPEATED, "PodResources")],
    "PodResources": [
        ("name", 1, F.TYPE_STRING, OPTIONAL, ""),
        ("namespace", 2, F.TYPE_STRING, OPTIONAL, ""),
        ("containers", 3, F.TYPE_MESSAGE, REPEATED, "ContainerResources"),
    ],
    "ContainerResources": [
        ("name", 1, F.TYPE_STRING, OPTIONAL, ""),
        ("devices", 2, F.TYPE_MESSAGE, REPEATED, "ContainerDevices"),
        ("cpu_ids", 3, F.TYPE_INT64, REPEATED, ""),
        ("memory", 4, F.TYPE_MESSAGE, REPEATED, "ContainerMemory"),
    ],
    "ContainerDevices": [
        ("resource_name", 1, F.TYPE_STRING, OPTIONAL, ""),
        ("device_ids", 2, F.TYPE_STRING, REPEATED, ""),
        ("topology", 3, F.TYPE_MESSAGE, OPTIONAL, "TopologyInfo"),
    ],
    "ContainerMemory": [
        ("memory_type", 1, F.TYPE_STRING, OPTIONAL, ""),
        ("size", 2, F.TYPE_UINT64, OPTIONAL, ""),
        ("topology", 3, F.TYPE_MESSAGE, OPTIONAL, "TopologyInfo"),
    ],
    "TopologyInfo": [("nodes", 1, F.TYPE_MESSAGE, REPEATED, "NUMANode")],
    "NUMANode": [("ID", 1, F.TYPE_INT64, OPTIONAL, "")],
}


def message_classes() -> dict[str, Any]:
    proto = descriptor_pb2.FileDescriptorProto(name="podresources_v1.proto", package="v1")
    proto.syntax = "proto3"
    for name, schema in SCHEMA.items():
        msg = proto.message_type.add(name=name)
        for field, number, type_, label, type_name in schema:
            f = msg.field.add(name=field, number=number, type=type_, label=label)
            if type_name:
                f.type_name = f".v1.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}"))
        for name in SCHEMA
    }


M = message_classes()

Handler = Callable[[bytes, Any], bytes]


@contextlib.contextmanager
def pod_resources_server(where: Path, handler: Handler) -> Iterator[str]:
    """A gRPC server on a new unix socket in `where` answering List with `handler`
    (request bytes, context) -> answer bytes; yields the socket's path."""
    path = str(where / f"kubelet-{uuid.uuid4().hex[:8]}.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    method = grpc.unary_unary_rpc_method_handler(
        handler, request_deserializer=None, response_serializer=None
    )
    service, _, name = LIST.strip("/").partition("/")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {name: method}),)
    )
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        yield path
    finally:
        server.stop(None)


def list_answer(
    pods: list[tuple[str, str, list[tuple[str, dict[str, list[str]], list[int]]]]],
) -> bytes:
    """A ListPodResourcesResponse: (namespace, pod, [(container, {resource: ids}, cpu ids)])."""
    resp = M["ListPodResourcesResponse"]()
    for namespace, name, containers in pods:
        pod = resp.pod_resources.add(name=name, namespace=namespace)
        for cname, devices, cpus in containers:
            c = pod.containers.add(name=cname)
            for resource, ids in devices.items():
                c.devices.add(resource_name=resource, device_ids=ids)
            c.cpu_ids.extend(cpus)
    data: bytes = resp.SerializeToString()
    return data
