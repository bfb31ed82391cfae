"""Logical CPUs: online/possible/present masks and per-CPU topology (reads via HostFS).

Files and meanings: Documentation/ABI/stable/sysfs-devices-system-cpu and
Documentation/admin-guide/cputopology.rst. `parse_*` are pure; `read_*` go
through HostFS and raise TopologyError naming the file and the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from supervisor.cpulist import parse_cpulist
from supervisor.errors import TopologyError
from supervisor.hostfs import HostFS
from supervisor.topology.model import Cpu

CPU_DIR = "sys/devices/system/cpu"


def parse_list_text(text: str, rel: str, what: str) -> frozenset[int]:
    """A cpulist/nodelist file's contents, or TopologyError naming file and value."""
    try:
        return parse_cpulist(text)
    except ValueError as err:
        raise TopologyError(f"garbled {what} in {rel}: {err}", rel) from None


def parse_int_text(text: str, rel: str, what: str) -> int:
    """A file holding one integer, or TopologyError. Decimal (may be negative), or
    hex with 0x where the kernel prints with %#x (ubcore's `numa`: "0x02")."""
    body = text.strip()
    try:
        if body.lower().startswith(("0x", "-0x")):
            return int(body, 16)
        return int(body, 10)
    except ValueError:
        raise TopologyError(f"garbled {what} in {rel}: {body!r} is not an integer", rel) from None


def read_list_file(fs: HostFS, rel: str, what: str) -> frozenset[int]:
    """A required list file (missing or garbled -> TopologyError)."""
    return parse_list_text(fs.read_required(rel, what), rel, what)


def read_optional_list(fs: HostFS, rel: str, what: str) -> frozenset[int] | None:
    """A list file that may be absent (None); garbled -> TopologyError."""
    text = fs.read_optional(rel)
    return None if text is None else parse_list_text(text, rel, what)


def read_optional_int(fs: HostFS, rel: str, what: str) -> int | None:
    """An integer file that may be absent (None); garbled -> TopologyError."""
    text = fs.read_optional(rel)
    return None if text is None else parse_int_text(text, rel, what)


@dataclass(frozen=True, slots=True)
class CpuMasks:
    """The three system-wide CPU masks; possible and present may be wider than online."""

    online: frozenset[int]
    present: frozenset[int]
    possible: frozenset[int]


def read_cpu_masks(fs: HostFS) -> CpuMasks:
    online = read_list_file(fs, f"{CPU_DIR}/online", "online CPU list")
    if not online:
        raise TopologyError(f"no online CPUs in {CPU_DIR}/online", f"{CPU_DIR}/online")
    # present/possible are informative (hot-plug slots); old kernels may lack them.
    present = read_optional_list(fs, f"{CPU_DIR}/present", "present CPU list") or online
    possible = read_optional_list(fs, f"{CPU_DIR}/possible", "possible CPU list") or present
    return CpuMasks(online=online, present=present | online, possible=possible | present | online)


def read_cpu(
    fs: HostFS, cpu: int, online: frozenset[int], node: int, package: int | None = None
) -> Cpu:
    """One online CPU's topology files.

    core_cpus_list (5.x) replaced thread_siblings_list; die_id (5.2) and
    cluster_id (5.16) are absent on older kernels: die defaults to 0, cluster
    to -1 (no cluster level). A CPU without a topology directory at all (some
    VMs, CONFIG_SMP quirks) is its own core in package 0.
    """
    d = f"{CPU_DIR}/cpu{cpu}/topology"
    core = read_optional_int(fs, f"{d}/core_id", "core id")
    if package is None:
        package = read_optional_int(fs, f"{d}/physical_package_id", "package id")
    die = read_optional_int(fs, f"{d}/die_id", "die id")
    cluster = read_optional_int(fs, f"{d}/cluster_id", "cluster id")
    siblings = read_optional_list(fs, f"{d}/core_cpus_list", "core CPU list")
    if siblings is None:
        siblings = read_optional_list(fs, f"{d}/thread_siblings_list", "thread sibling list")
    # Offline siblings are not usable; the CPU itself is always its own sibling.
    sibs = ((siblings or frozenset()) & online) | {cpu}
    return Cpu(
        id=cpu,
        core=cpu if core is None else core,
        package=0 if package is None else package,
        die=0 if die is None else die,
        cluster=-1 if cluster is None else cluster,
        node=node,
        siblings=frozenset(sibs),
    )


def read_cpus(fs: HostFS, online: frozenset[int], node_of: Mapping[int, int]) -> tuple[Cpu, ...]:
    """Every online CPU, by id; `node_of` maps CPU -> node (missing: -1).

    SMT siblings share core, package, die and cluster by definition
    (cputopology.rst), so each core's files are read once, through its first
    online thread, and a package's id once, through package_cpus_list: half
    the reads on an SMT host, where discovery's cost is almost all
    small-file opens.
    """
    cpus: dict[int, Cpu] = {}
    package_of: dict[int, int] = {}  # from package_cpus_list, read once per package
    for cpu in sorted(online):
        if cpu in cpus:
            continue
        first = read_cpu(fs, cpu, online, node_of.get(cpu, -1), package_of.get(cpu))
        cpus[cpu] = first
        if cpu not in package_of:
            rel = f"{CPU_DIR}/cpu{cpu}/topology/package_cpus_list"
            for member in read_optional_list(fs, rel, "package CPU list") or ():
                package_of[member] = first.package
        for sibling in first.siblings - {cpu}:
            cpus[sibling] = replace(first, id=sibling, node=node_of.get(sibling, -1))
    l3 = read_l3_domains(fs, online)
    return tuple(replace(cpus[c], l3=l3.get(c)) if l3 else cpus[c] for c in sorted(cpus))


def read_l3_domains(fs: HostFS, online: frozenset[int]) -> dict[int, int]:
    """CPU -> its L3 domain, named by the domain's lowest CPU; {} where not known.

    cache/index3 is the L3 where `level` says 3 (Documentation/ABI/testing/
    sysfs-devices-system-cpu, "cache/indexX"); its shared_cpu_list is every
    CPU behind that cache (an EPYC CCD/CCX, a Xeon socket or sub-NUMA
    cluster). Read once per domain, and not at all where the first CPU has
    no index3 (VMs, older kernels, fixture trees).
    """
    if not online:
        return {}
    first = f"{CPU_DIR}/cpu{min(online)}/cache/index3"
    level = fs.read_optional(f"{first}/level")
    if level is None or level.strip() != "3":
        return {}
    domain_of: dict[int, int] = {}
    for cpu in sorted(online):
        if cpu in domain_of:
            continue
        rel = f"{CPU_DIR}/cpu{cpu}/cache/index3/shared_cpu_list"
        members = (read_optional_list(fs, rel, "L3 shared CPU list") or frozenset()) & online
        members |= {cpu}
        name = min(members)
        for member in members:
            domain_of.setdefault(member, name)
    return domain_of
