"""NUMA nodes: CPUs, memory and SLIT distances per node (reads via HostFS).

Files: Documentation/ABI/stable/sysfs-devices-node. A kernel built without
CONFIG_NUMA has no node directory at all: then there is one node 0 holding
every online CPU, with MemTotal from /proc/meminfo.
"""

from __future__ import annotations

import re

from supervisor.errors import TopologyError
from supervisor.hostfs import HostFS
from supervisor.topology.cpus import parse_list_text, read_list_file, read_optional_list
from supervisor.topology.model import Node

NODE_DIR = "sys/devices/system/node"

_MEMTOTAL = re.compile(r"^(?:Node\s+\d+\s+)?MemTotal:\s+(\d+)\s+kB\s*$", re.MULTILINE)


def parse_meminfo_total_bytes(text: str, rel: str) -> int:
    """MemTotal of a node (or /proc/meminfo) in bytes; the kernel prints kB (KiB)."""
    match = _MEMTOTAL.search(text)
    if match is None:
        raise TopologyError(f"no MemTotal line in {rel}", rel)
    return int(match.group(1)) * 1024


def parse_distance(text: str, node_ids: list[int], rel: str) -> tuple[tuple[int, int], ...]:
    """A node's distance row: one value per online node, in node order
    (drivers/base/node.c node_read_distance walks for_each_online_node)."""
    fields = text.split()
    try:
        values = list(map(int, fields))  # int() is base 10, like int(f, 10)
    except ValueError:
        raise TopologyError(f"garbled distance row in {rel}: {text.strip()!r}", rel) from None
    if len(values) != len(node_ids):
        raise TopologyError(
            f"distance row in {rel} has {len(values)} values for {len(node_ids)} online nodes: "
            f"{text.strip()!r}",
            rel,
        )
    return tuple(zip(node_ids, values, strict=True))


def read_node(fs: HostFS, node: int, node_ids: list[int], online: frozenset[int]) -> Node:
    d = f"{NODE_DIR}/node{node}"
    cpus = read_list_file(fs, f"{d}/cpulist", "node CPU list") & online
    meminfo = fs.read_optional(f"{d}/meminfo")
    mem = 0 if meminfo is None else parse_meminfo_total_bytes(meminfo, f"{d}/meminfo")
    text = fs.read_optional(f"{d}/distance")
    # A missing distance row: assume the ACPI defaults (10 local, 20 remote).
    dist = (
        tuple((n, 10 if n == node else 20) for n in node_ids)
        if text is None
        else parse_distance(text, node_ids, f"{d}/distance")
    )
    return Node(id=node, cpus=cpus, mem_total_bytes=mem, distances=dist)


def read_node_ids(fs: HostFS) -> list[int] | None:
    """Online node ids, or None when the kernel has no NUMA support (no node dir)."""
    text = fs.read_optional(f"{NODE_DIR}/online")
    if text is not None:
        ids = parse_list_text(text, f"{NODE_DIR}/online", "online node list")
        if ids:
            return sorted(ids)
    found = sorted(
        int(name[4:])
        for name in fs.listdir(NODE_DIR)
        if name.startswith("node") and name[4:].isdigit()
    )
    return found or None


def read_nodes(fs: HostFS, online: frozenset[int]) -> tuple[Node, ...]:
    """Online nodes in id order, with and without CPUs or memory."""
    node_ids = read_node_ids(fs)
    if node_ids is None:
        meminfo = fs.read_optional("proc/meminfo")
        mem = 0 if meminfo is None else parse_meminfo_total_bytes(meminfo, "proc/meminfo")
        return (Node(id=0, cpus=online, mem_total_bytes=mem, distances=((0, 10),)),)
    # has_cpu / has_memory only restate what cpulist and meminfo say; read
    # them so snapshots carry them for people comparing with numactl -H.
    read_optional_list(fs, f"{NODE_DIR}/has_cpu", "node list")
    read_optional_list(fs, f"{NODE_DIR}/has_memory", "node list")
    return tuple(read_node(fs, n, node_ids, online) for n in node_ids)


def node_of_cpus(nodes: tuple[Node, ...]) -> dict[int, int]:
    """CPU id -> node id (a CPU listed by two nodes keeps the lower node)."""
    result: dict[int, int] = {}
    for node in sorted(nodes, key=lambda n: -n.id):
        for cpu in node.cpus:
            result[cpu] = node.id
    return result
