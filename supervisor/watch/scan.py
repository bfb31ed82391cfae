"""One check pass's reads (blocking: run in the daemon's executor; I/O through HostFS).

`scan(...)` reads, for each `ScanTarget`, the process's threads (through its
`observe.ThreadScanner`), its resident memory per node (its cgroup's
memory.numa_stat when it has one, else numa_maps when due), its planned IRQs
(through the IRQ keeper), and the supervisor's own allowed CPUs and nodes
with the online CPUs. It returns an immutable `ScanResult`; the loop decides
on it (supervisor.watch.decide). `read_allowed` is the small read the fast
cpuset watch repeats on its own period.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from supervisor.bind.cgroup import CgroupManager, ProcessCgroup
from supervisor.errors import Gone, KernelError, SupervisorError
from supervisor.hostfs import HostFS
from supervisor.plan.placement import Placement, Slot
from supervisor.plan.replan import AllowedSet, normalize_allowed
from supervisor.plan.threads import ProcessKind, RoleMatcher
from supervisor.state import IrqObservation, Observation, ProcKey
from supervisor.topology.model import Topology
from supervisor.watch.decide import Seen
from supervisor.watch.observe import (
    ThreadScanner,
    observe_process,
    read_online_cpus,
    read_self_allowed,
)


class IrqKeeperLike(Protocol):
    """What the loop needs of `supervisor.watch.irqs.IrqKeeper` (blocking; run in the executor)."""

    def observe(self) -> Mapping[ProcKey, tuple[IrqObservation, ...]]: ...

    def enforce(self, key: ProcKey) -> Iterable[object]: ...

    def replan(self, placement: Placement, topology: Topology | None = None) -> object: ...


@dataclass(frozen=True, slots=True)
class ScanTarget:
    """One running process to read this pass (the scanner is the loop's, per process)."""

    key: ProcKey
    pid: int
    slot: Slot
    kind: ProcessKind
    scanner: ThreadScanner
    matcher: RoleMatcher
    cgroup: ProcessCgroup | None  # read its memory.numa_stat
    read_maps: bool  # else: numa_maps is due
    previous: Observation | None  # memory carried over when none is read


@dataclass(frozen=True, slots=True)
class ScanResult:
    allowed: AllowedSet | None
    host_error: str | None
    seen: Mapping[ProcKey, Seen | None]  # None: the process is gone
    errors: Mapping[ProcKey, str]
    irq_error: str | None


def read_allowed(fs: HostFS, node_ids: Iterable[int]) -> AllowedSet:
    """The supervisor's allowed CPUs (online ones) and nodes, as discovery computes them.

    Two small reads and the cgroup's cpuset files: what a cpuset write or a
    hotplug changes. Raises SupervisorError or OSError when unreadable.
    """
    cpus, mems = read_self_allowed(fs)
    return normalize_allowed(cpus, mems, read_online_cpus(fs), node_ids)


def scan(
    fs: HostFS,
    targets: Sequence[ScanTarget],
    *,
    node_ids: Iterable[int],
    irqs: IrqKeeperLike | None,
    cgroups: CgroupManager | None,
    with_allowed: bool = True,
) -> ScanResult:
    """Every read of one pass; failures isolated per process, the IRQs and the host."""
    allowed: AllowedSet | None = None
    host_error: str | None = None
    if with_allowed:
        try:
            allowed = read_allowed(fs, node_ids)
        except (SupervisorError, OSError) as err:
            host_error = str(err)
    irq_obs: Mapping[ProcKey, tuple[IrqObservation, ...]] = {}
    irq_error: str | None = None
    if irqs is not None:
        try:
            irq_obs = irqs.observe()
        except Exception as err:  # the IRQ keeper's failure is not the processes'
            irq_error = f"{type(err).__name__}: {err}"
    seen: dict[ProcKey, Seen | None] = {}
    errors: dict[ProcKey, str] = {}
    for t in targets:
        numa_stat: dict[int, int] | None = None
        if t.cgroup is not None and cgroups is not None:
            try:
                numa_stat = cgroups.read_numa_stat(t.cgroup)
            except KernelError:
                numa_stat = None  # fall back to the previous value
        try:
            observation = observe_process(
                fs,
                t.pid,
                t.slot,
                t.kind,
                scanner=t.scanner,
                matcher=t.matcher,
                numa_stat=numa_stat,
                read_numa_maps=t.read_maps,
                previous=t.previous,
            )
        except Gone:
            seen[t.key] = None
            continue
        except KernelError as err:
            errors[t.key] = str(err)
            continue
        if t.key in irq_obs:
            observation = replace(observation, irqs=irq_obs[t.key])
        seen[t.key] = Seen(t.key, t.pid, observation, t.read_maps or t.cgroup is not None)
    return ScanResult(allowed, host_error, seen, errors, irq_error)
