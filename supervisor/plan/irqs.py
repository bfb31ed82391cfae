"""Which IRQs each rank owns and the CPUs they belong on (pure, no I/O).

`plan_irqs()` says which IRQs each rank owns: its device's IRQs and, with
`[irq] nic = true`, those of its paired NIC (`pair_nics`), each targeted at
the rank's `irq` role CPUs. `with_irqs()` is the planner's last step: it puts
them on the Placement (`RankPlacement.irqs`), so a re-plan yields its IRQ plan
the same way. supervisor.watch.irqs.IrqKeeper keeps exactly those there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from supervisor.plan.keys import ProcKey
from supervisor.plan.placement import (
    DeviceRef,
    IrqAssignment,
    IrqSource,
    Placement,
    PlanSettings,
    RankPlacement,
)
from supervisor.topology.accelerators import CPU
from supervisor.topology.model import Device, Nic, Topology

# Sort keys for "unknown": after every real SLIT distance (those are 10..255,
# ACPI 6.5 section 5.2.17) and after every real PCI address difference.
_UNKNOWN_DISTANCE = 256
_FAR_PCI = (1 << 16, 1 << 8, 1 << 5, 1 << 3)


@dataclass(frozen=True, slots=True)
class NicFunction:
    """A NIC as one PCI function: an HCA and its netdev (mlx5_0 and ibp24s0) are one."""

    name: str
    bdf: str
    numa_node: int | None
    irqs: tuple[int, ...]


def nic_functions(nics: Iterable[Nic]) -> tuple[NicFunction, ...]:
    """NICs merged by PCI function, by address; functions without IRQs are left out.

    The name is the InfiniBand device's where there is one (discovery lists
    infiniband before net), else the netdev's.
    """
    by_bdf: dict[str, NicFunction] = {}
    for nic in nics:
        if nic.bdf is None or nic.bdf in by_bdf or not nic.irqs:
            continue
        by_bdf[nic.bdf] = NicFunction(nic.name, nic.bdf, nic.numa_node, tuple(sorted(nic.irqs)))
    return tuple(by_bdf[bdf] for bdf in sorted(by_bdf))


def parse_bdf(bdf: str) -> tuple[int, int, int, int] | None:
    """("0000:18:00.0") -> (domain, bus, device, function); None when not an address."""
    try:
        domain, bus, rest = bdf.split(":")
        dev, fn = rest.split(".")
        return int(domain, 16), int(bus, 16), int(dev, 16), int(fn, 16)
    except ValueError:
        return None


def pci_proximity(a: str | None, b: str | None) -> tuple[int, int, int, int]:
    """How far apart two PCI addresses are: per field, domain first (pure).

    Without the PCIe tree (which we do not read) the address is the best proxy:
    a GPU and the HCA on its PCIe switch have close bus numbers
    (0000:1b:00.0 and 0000:18:00.0 on a DGX H100).
    """
    pa = None if a is None else parse_bdf(a)
    pb = None if b is None else parse_bdf(b)
    if pa is None or pb is None:
        return _FAR_PCI
    return (abs(pa[0] - pb[0]), abs(pa[1] - pb[1]), abs(pa[2] - pb[2]), abs(pa[3] - pb[3]))


def node_proximity(topology: Topology, a: int | None, b: int | None) -> tuple[int, int]:
    """(0 same node / 1 other, SLIT distance); unknown nodes sort after all known."""
    if a is None or b is None:
        return (1, _UNKNOWN_DISTANCE)
    if a == b:
        return (0, 0)
    distance: int | None = None
    for node in topology.nodes:
        if node.id == a:
            distance = node.distance_to(b)
    return (1, _UNKNOWN_DISTANCE - 1 if distance is None else distance)


def _rank_anchor(rank: RankPlacement) -> DeviceRef:
    """The device a rank's NIC should be near: its first device."""
    return rank.all_devices[0]


def pair_nics(
    topology: Topology, ranks: Sequence[RankPlacement], nics: Sequence[NicFunction]
) -> dict[int, NicFunction]:
    """The NIC each rank number is paired with (pure, deterministic).

    Pairs are taken in order of: same NUMA node first, then SLIT distance;
    within one distance, ranks in order, each taking the free NIC closest by
    PCI address (`pci_proximity`; the NIC address breaks ties). So every rank
    gets a NIC on its own node before any rank gets a remote one, and with at
    least as many NICs as ranks each NIC serves at most one rank; extra NICs
    (storage ports) are left alone. With fewer NICs,
    a rank left over shares its cheapest NIC among those it is no farther
    from, by node, than the NIC's first rank (so a NIC's IRQs never go to a
    farther socket than they must); `plan_irqs` then splits that NIC's IRQs
    between the ranks sharing it. A rank with no such NIC gets none.
    """
    if not ranks or not nics:
        return {}

    def cost(rank: RankPlacement, nic: NicFunction) -> tuple[Any, ...]:
        dev = _rank_anchor(rank)
        return (
            node_proximity(topology, dev.numa_node, nic.numa_node),
            rank.rank,
            pci_proximity(dev.bus_id, nic.bdf),
            nic.bdf,
        )

    pairs = sorted((cost(r, n), r.rank, i) for r in ranks for i, n in enumerate(nics))
    chosen: dict[int, int] = {}  # rank number -> NIC index
    first_rank: dict[int, RankPlacement] = {}  # NIC index -> the rank it was paired with
    by_rank = {r.rank: r for r in ranks}
    for _, rank_no, i in pairs:
        if rank_no in chosen or i in first_rank:
            continue
        chosen[rank_no] = i
        first_rank[i] = by_rank[rank_no]
    for r in ranks:
        if r.rank in chosen:
            continue
        # Share only a NIC this rank is no farther from (by node) than the
        # rank it serves: a NIC's IRQs never move to a farther socket.
        fair = [
            i for i, first in first_rank.items() if cost(r, nics[i])[0] <= cost(first, nics[i])[0]
        ]
        if fair:
            chosen[r.rank] = min(fair, key=lambda i: cost(r, nics[i]))
    return {rank_no: nics[i] for rank_no, i in chosen.items()}


def _find_device(topology: Topology, ref: DeviceRef) -> Device | None:
    for d in topology.devices:
        if d.kind == ref.kind and d.index == ref.index:
            return d
    if ref.bus_id is not None:
        for d in topology.devices:
            if d.bdf == ref.bus_id:
                return d
    return None


def plan_irqs(
    topology: Topology, placement: Placement, *, nic: bool
) -> Mapping[ProcKey, tuple[IrqAssignment, ...]]:
    """Every rank's IRQs and their target CPUs, the rank's `irq` role (pure).

    A rank owns the IRQs of its device(s) (msi_irqs of the PCI function plus
    /proc/interrupts lines naming it; `cpu` stand-ins have none) and, when
    `nic`, those of its paired NIC (`pair_nics`; a NIC that is itself a rank's
    device is not paired again). A NIC shared by several ranks has its IRQs
    dealt out in contiguous runs, in rank order. An IRQ belongs to at most one
    rank: the first claim wins (devices before NICs, lower rank first).
    Targets are `slot.role_cpus("irq")`, which is `main` where roles merged.
    Every rank of the placement has an entry, possibly empty.
    """
    names = {i.number: i.name for i in topology.irqs}
    claimed: set[int] = set()
    out: dict[int, list[IrqAssignment]] = {r.rank: [] for r in placement.ranks}
    targets = {r.rank: tuple(sorted(set(r.slot.role_cpus("irq")))) for r in placement.ranks}

    def claim(rank_no: int, irq: int, source: IrqSource, owner: str, bdf: str | None) -> None:
        if irq in claimed or not targets[rank_no]:
            return
        claimed.add(irq)
        out[rank_no].append(
            IrqAssignment(irq, targets[rank_no], source, owner, bdf, names.get(irq, ""))
        )

    device_bdfs: set[str] = set()
    for rank in placement.ranks:
        for ref in rank.all_devices:
            if ref.bus_id is not None:
                device_bdfs.add(ref.bus_id)
            dev = _find_device(topology, ref)
            if dev is None or dev.kind == CPU.name:
                continue
            if dev.bdf is not None:
                device_bdfs.add(dev.bdf)
            for irq in sorted(dev.irqs):
                claim(rank.rank, irq, "device", dev.label, dev.bdf)
    if nic:
        functions = tuple(f for f in nic_functions(topology.nics) if f.bdf not in device_bdfs)
        paired = pair_nics(topology, placement.ranks, functions)
        sharers: dict[str, list[int]] = {}
        for rank_no in sorted(paired):
            sharers.setdefault(paired[rank_no].bdf, []).append(rank_no)
        for f in functions:
            ranks = sharers.get(f.bdf)
            if not ranks:
                continue
            for i, irq in enumerate(f.irqs):
                claim(ranks[i * len(ranks) // len(f.irqs)], irq, "nic", f.name, f.bdf)
    return MappingProxyType(
        {rank_no: tuple(sorted(a, key=lambda x: x.irq)) for rank_no, a in out.items()}
    )


def with_irqs(topology: Topology, placement: Placement, settings: PlanSettings) -> Placement:
    """`placement` with every rank's planned IRQs on it (`RankPlacement.irqs`; pure).

    With IRQ binding off (`settings.irqs`, the config's `[irq] enabled`) the
    plan holds no IRQs at all: nothing to write, nothing to check.
    """
    if not settings.irqs:
        return replace(placement, ranks=tuple(replace(r, irqs=()) for r in placement.ranks))
    planned = plan_irqs(topology, placement, nic=settings.irq_nic)
    return replace(
        placement, ranks=tuple(replace(r, irqs=planned[r.rank]) for r in placement.ranks)
    )
