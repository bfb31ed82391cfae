"""Which of the host's accelerators a container can reach: the device nodes in its /dev.

A container runtime gives a container the nodes of the accelerators it was
allotted and no others (the NVIDIA Container Toolkit, a CDI spec, a device
plugin's `devices` answer, `runc`'s `linux.devices`), under any name: the
host's /dev/nvidia3 may be the container's /dev/nvidia0. The nodes are there
from the container's first instruction, before its engine opens any (a CUDA
context opens its GPUs' nodes only when it starts, so what the processes hold
open says nothing for the first minute of a vLLM start-up). Each node's number
(stat(2) through /proc/<pid>/root, the container's mount namespace) is matched
to a PCI address by the host's driver (supervisor.topology.device_minors).

Reading /proc/<pid>/root needs ptrace access to the process, as its environ
does (CAP_SYS_PTRACE for another user's: the DaemonSet has it). What cannot be
told (that access refused, or a node whose number no driver names, as when the
host's driver procfs is hidden) is `unknown`: the node agent then lets its child
plan every accelerator of the host, as it did before it read the nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from supervisor.hostfs import HostFS
from supervisor.topology.accelerators import KINDS, DeviceNode

# Every kind's node directories ("dev", "dev/dri") with the nodes found in each.
NODES: Mapping[str, tuple[DeviceNode, ...]] = {
    d: tuple(n for k in KINDS for n in k.device_nodes if n.dir == d)
    for d in sorted({n.dir for k in KINDS for n in k.device_nodes})
}


@dataclass(frozen=True, slots=True)
class Reach:
    """The accelerators a container reaches (PCI addresses, sorted), or why unknown,
    and where that was read: its device nodes, or the kubelet's Pod Resources API
    (supervisor.agent.pod_resources)."""

    devices: tuple[str, ...] | None
    unknown: str | None = None
    source: str = "device-nodes"


def container_reach(fs: HostFS, pid: int, numbers: Mapping[tuple[int, int], str]) -> Reach:
    """The accelerators whose nodes are in `pid`'s /dev (`numbers`: the host's
    (major, minor) -> PCI address, device_minors.read_char_devices)."""
    found: set[str] = set()
    unmatched: list[str] = []
    for where, nodes in NODES.items():
        rel = f"proc/{pid}/root/{where}"
        try:
            names = fs.listdir_or_raise(rel)
        except FileNotFoundError:
            if where == "dev":  # the process is gone (a missing dev/dri is a host without one)
                return Reach(None, f"/proc/{pid}/root/dev: gone")
            continue
        except OSError as err:
            return Reach(None, f"/proc/{pid}/root/{where}: {err.strerror or err}")
        for name in names:
            if not any(node.number_of(name) is not None for node in nodes):
                continue
            number = fs.char_device(f"{rel}/{name}")
            if number is None:
                continue  # not a character device: a runtime's placeholder file
            bdf = numbers.get(number)
            if bdf is None:
                unmatched.append(f"/{where}/{name} ({number[0]}:{number[1]})")
            else:
                found.add(bdf)
    if unmatched:
        return Reach(None, f"no driver names {', '.join(unmatched)}")
    return Reach(tuple(sorted(found)))
