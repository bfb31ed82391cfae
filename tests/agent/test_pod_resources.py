"""The kubelet's Pod Resources API as the agent calls it: a real gRPC server (grpcio,
the C core's HTTP/2, on a unix socket as the kubelet serves it) answers
`v1.PodResourcesLister/List` with messages the protobuf runtime encodes from the
v1 schema (tests/support/kubelet.py), and supervisor.agent.pod_resources reads
them with its own HTTP/2, HPACK and protobuf code."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from supervisor.agent.grpc_unix import GrpcError
from supervisor.agent.pod_resources import (
    Allotted,
    Devices,
    allotted_pci,
    list_pod_resources,
    nvidia_uuids,
    parse_list_answer,
)
from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from tests.support.daemon_support import REPO
from tests.support.kubelet import Handler, M, pod_resources_server

UUID2 = "GPU-8f6c2a4e-1111-2222-3333-000000000002"


def answer(pods: int = 1) -> bytes:
    """`pods` vLLM pods (the first with GPUs by UUID and exclusive CPUs) and an AMD one."""
    resp = M["ListPodResourcesResponse"]()
    for i in range(pods):
        pod = resp.pod_resources.add(name=f"vllm-{i}", namespace="serving")
        c = pod.containers.add(name="engine")
        gpus = c.devices.add(resource_name="nvidia.com/gpu", device_ids=[UUID2, "MIG-1/2/3"])
        gpus.topology.nodes.add(ID=1)
        c.cpu_ids.extend([9, 8, 10, 11])
        mem = c.memory.add(memory_type="memory", size=1 << 30)  # a field the agent skips
        mem.topology.nodes.add(ID=1)
        pod.containers.add(name="sidecar")
    amd = resp.pod_resources.add(name="sglang", namespace="ml").containers.add(name="sglang")
    amd.devices.add(resource_name="amd.com/gpu", device_ids=["0000:C1:00.0"])
    data: bytes = resp.SerializeToString()
    return data


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[Callable[[Handler], str]]:
    """Starts a Pod Resources server with the given handler; yields its socket."""
    with contextlib.ExitStack() as stack:
        yield lambda handler: stack.enter_context(pod_resources_server(tmp_path, handler))


def test_the_list_answer_is_read_from_a_real_grpc_server(kubelet: Any) -> None:
    seen: list[bytes] = []

    def handler(request: bytes, _context: Any) -> bytes:
        seen.append(request)
        return answer()

    got = asyncio.run(list_pod_resources(kubelet(handler)))
    assert seen == [b""]  # ListPodResourcesRequest is empty
    gpus = Devices("nvidia.com/gpu", (UUID2, "MIG-1/2/3"), (1,))
    assert got == [
        Allotted("serving", "vllm-0", "engine", (gpus,), (8, 9, 10, 11)),
        Allotted("serving", "vllm-0", "sidecar", (), ()),
        Allotted("ml", "sglang", "sglang", (Devices("amd.com/gpu", ("0000:C1:00.0",), ()),), ()),
    ]


def test_a_large_answer_crosses_frames_and_windows(kubelet: Any) -> None:
    """2,000 pods, some 290 KiB: many DATA frames, past the default 64 KiB window."""
    data = answer(2000)
    assert len(data) > 4 * 65_535
    got = asyncio.run(list_pod_resources(kubelet(lambda _r, _c: data)))
    assert len(got) == 4001 and got[-2].pod == "vllm-1999"


def test_a_grpc_error_status_is_named(kubelet: Any) -> None:
    def refuse(_request: bytes, context: Any) -> bytes:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not for you")

    with pytest.raises(GrpcError, match="grpc-status 7: not for you"):
        asyncio.run(list_pod_resources(kubelet(refuse)))


def test_no_socket_and_no_server_are_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "kubelet.sock")
    with pytest.raises(GrpcError, match=f"{missing}: No such file"):
        asyncio.run(list_pod_resources(missing))


def test_a_garbled_answer_is_an_error_not_a_crash() -> None:
    with pytest.raises(GrpcError, match="runs past the message"):
        parse_list_answer(b"\x0a\x05\x0a\x10abc")


def test_device_ids_resolve_by_uuid_and_pci_address(tmp_path: Path) -> None:
    root = (
        FakeHost(tmp_path)
        .cpus(2, 2, 1)
        .nvidia_gpu("0000:1a:00.0", 0)
        .nvidia_gpu("0000:9a:00.0", 1, uuid=UUID2)
        .build()
    )
    uuids = nvidia_uuids(HostFS(str(root)))
    assert uuids[UUID2.lower()] == "0000:9a:00.0" and len(uuids) == 2
    engine, _, amd = parse_list_answer(answer())
    assert allotted_pci(engine, uuids) == (("0000:9a:00.0",), ("nvidia.com/gpu=MIG-1/2/3",))
    assert allotted_pci(amd, uuids) == (("0000:c1:00.0",), ())


READ_ONLY_CALL = r"""
set -eu
mount --bind "$1" "$1"
mount -o remount,bind,ro "$1" "$1"
if touch "$1/probe" 2>/dev/null; then echo "the mount is writable"; exit 1; fi
exec "$2" -c '
import asyncio, sys
from supervisor.agent.pod_resources import list_pod_resources
print(len(asyncio.run(list_pod_resources(sys.argv[1]))))
' "$3"
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mount(2) in a new mount namespace needs root")
def test_the_socket_answers_through_a_read_only_mount(kubelet: Any) -> None:
    """As the DaemonSet mounts /var/lib/kubelet/pod-resources: read-only. connect(2)
    needs write permission on the socket, which a read-only mount does not take away."""
    socket = kubelet(lambda _r, _c: answer())
    where = os.path.dirname(socket)
    unshare = ("unshare", "--mount", "--propagation", "private")
    got = subprocess.run(
        [*unshare, "sh", "-c", READ_ONLY_CALL, "ro", where, sys.executable, socket],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert got.returncode == 0 and got.stdout.strip() == "3", (got.stdout, got.stderr)
