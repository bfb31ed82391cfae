"""Device and NIC interrupts of each rank: plan them (pure), keep them on the rank's
`irq` CPUs (does I/O: /proc/irq through IrqBinder, irqbalance's control socket).

`plan_irqs()` says which IRQs each rank owns: its device's IRQs and, with
`[irq] nic = true`, those of its paired NIC. `IrqKeeper` writes them, reads
them back, reports drift (irqbalance or an operator moving one), re-writes on
request and puts the originals back when the daemon stops. Its methods block
(file writes, a unix socket): the daemon calls them from its executor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from supervisor.bind.irq import (
    IrqbalanceInfo,
    IrqBinder,
    ban_irqs,
    detect_irqbalance,
    read_banned_irqs,
)
from supervisor.config import IrqConfig
from supervisor.cpulist import format_cpulist, parse_cpulist
from supervisor.errors import Denied, KernelError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
from supervisor.plan.placement import DeviceRef, Placement, RankPlacement
from supervisor.state import IrqObservation, ProcKey, StateStore, key_label
from supervisor.topology.model import Device, Nic, Topology

log = logging.getLogger("placement_supervisor.irqs")

IrqSource = Literal["device", "nic"]
IrqStatus = Literal["planned", "bound", "managed", "gone", "failed", "off"]

# Sort keys for "unknown": after every real SLIT distance (those are 10..255,
# ACPI 6.5 section 5.2.17) and after every real PCI address difference.
_UNKNOWN_DISTANCE = 256
_FAR_PCI = (1 << 16, 1 << 8, 1 << 5, 1 << 3)


# -- planning (pure) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IrqAssignment:
    """One IRQ a rank owns and the CPUs it should be delivered to."""

    irq: int
    cpus: tuple[int, ...]  # the rank's `irq` role CPUs, sorted
    source: IrqSource  # the rank's own device, or its paired NIC
    owner: str  # "nvidia0", "pci0", or the NIC's name ("mlx5_0")
    bdf: str | None
    name: str = ""  # the /proc/interrupts action ("mlx5_comp3@pci:0000:18:00.0")


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
            if dev is None or dev.kind == "cpu":
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


# -- reading one IRQ --------------------------------------------------------------------


def read_irq_delivery(fs: HostFS, irq: int) -> tuple[int, ...] | None:
    """The CPUs IRQ `irq` is delivered to, as far as the kernel knows; None when gone.

    effective_affinity_list when it lies inside smp_affinity_list. On x86
    without interrupt remapping a new affinity takes effect at the IRQ's next
    interrupt (the vector moves in the interrupt path,
    kernel/irq/migration.c), so right after a write, and forever for an IRQ
    that never fires, the effective CPU still names the old target. The
    affinity itself is then what the next interrupt will use, and is reported.
    """
    affinity_text = fs.read_optional(f"proc/irq/{irq}/smp_affinity_list")
    effective_text = fs.read_optional(f"proc/irq/{irq}/effective_affinity_list")
    affinity = _parse_optional(affinity_text)
    effective = _parse_optional(effective_text)
    if affinity is None:
        return None if effective is None else tuple(sorted(effective))
    if effective and effective <= affinity:
        return tuple(sorted(effective))
    return tuple(sorted(affinity))


def _parse_optional(text: str | None) -> frozenset[int] | None:
    if text is None or not text.strip():
        return None
    try:
        return parse_cpulist(text)
    except ValueError:
        return None


# -- the keeper -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IrqOutcome:
    """What one write (or refusal) did to one IRQ."""

    key: ProcKey
    irq: int
    status: IrqStatus
    cpus: tuple[int, ...] = ()  # what the kernel reports after the write
    error: str | None = None


class IrqKeeper:
    """Keeps every rank's planned IRQs on its `irq` CPUs for the daemon's lifetime.

    Blocking: every public method reads or writes /proc/irq (and may talk to
    irqbalance's socket), so the daemon calls them through
    `loop.run_in_executor`. Calls are serialised by a lock. Store writes
    (events, counters) are handed to the event loop given as `loop` (default:
    the loop running where the keeper is built) with call_soon_threadsafe,
    since the StateStore has one writer; without a loop they are made at once.

    `enforce` counts each re-written IRQ in rebinds{reason="irq_drift"} unless
    `count_rebinds` is False (the daemon's check loop counts its irq_affinity
    re-writes itself).

    Failures never stop a worker: a kernel-managed IRQ is skipped and
    reported once (bind_failures{target="irq",reason="managed"}); a read-only
    /proc/irq (Denied) turns IRQ binding off for the run with one warning.
    """

    def __init__(
        self,
        fs: HostFS,
        store: StateStore,
        topology: Topology,
        placement: Placement,
        config: IrqConfig,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        count_rebinds: bool = True,
    ) -> None:
        self.fs = fs
        self.store = store
        self.topology = topology
        self.config = config
        self.binder = IrqBinder(fs)
        self._loop = loop if loop is not None else _running_loop()
        self._lock = threading.Lock()
        self._plan: Mapping[ProcKey, tuple[IrqAssignment, ...]] = plan_irqs(
            topology, placement, nic=config.nic
        )
        self._status: dict[int, IrqStatus] = {}
        self._reported: set[tuple[int, str]] = set()  # (irq, reason) failures already counted
        self._moved: dict[int, tuple[int, ...]] = {}  # IRQs seen off their CPUs, and where
        self._off_reason: str | None = None
        self._irqbalance: IrqbalanceInfo | None = None
        self._banned_before: frozenset[int] | None = None  # irqbalance's list before our ban
        self._banned: frozenset[int] = frozenset()
        self._count_rebinds = count_rebinds

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand later store writes to `loop` (for a keeper built before the loop ran)."""
        self._loop = loop

    def __repr__(self) -> str:
        return f"IrqKeeper({self.fs!r}, irqs={len(self.planned_irqs())}, off={self._off_reason!r})"

    # -- queries (no I/O) ------------------------------------------------------

    @property
    def plan(self) -> Mapping[ProcKey, tuple[IrqAssignment, ...]]:
        return self._plan

    @property
    def enabled(self) -> bool:
        """False when the config turns IRQ binding off or /proc/irq refused us."""
        return self.config.enabled and self._off_reason is None

    @property
    def off_reason(self) -> str | None:
        return self._off_reason

    @property
    def irqbalance(self) -> IrqbalanceInfo | None:
        """The irqbalance found at the last apply/enforce, if any."""
        return self._irqbalance

    @property
    def banned(self) -> frozenset[int]:
        """The IRQs irqbalance was asked to leave alone."""
        return self._banned

    def status(self, irq: int) -> IrqStatus:
        return self._status.get(irq, "planned")

    def planned_irqs(self, key: ProcKey | None = None) -> dict[int, tuple[int, ...]]:
        """IRQ -> planned CPUs of the IRQs we keep (bound ones), of one rank or all."""
        out: dict[int, tuple[int, ...]] = {}
        for k, assignments in self._plan.items():
            if key is not None and k != key:
                continue
            for a in assignments:
                if self._status.get(a.irq) == "bound":
                    out[a.irq] = a.cpus
        return out

    # -- apply ------------------------------------------------------------------

    def apply(self) -> tuple[IrqOutcome, ...]:
        """Write every planned IRQ's affinity; then ask irqbalance to keep off them.

        Blocking; call from the executor. Returns one outcome per IRQ tried.
        """
        if not self.config.enabled:
            return ()
        with self._lock:
            outcomes = self._apply_locked()
            self._coordinate_irqbalance()
        return outcomes

    def _apply_locked(self) -> tuple[IrqOutcome, ...]:
        outcomes: list[IrqOutcome] = []
        for key, assignments in self._plan.items():
            if self._off_reason is not None:
                break
            done = [self._bind_one(key, a) for a in assignments if self._off_reason is None]
            outcomes.extend(done)
            bound = [o for o in done if o.status == "bound"]
            if not assignments:
                continue
            label = key_label(key)
            cpus = format_cpulist(assignments[0].cpus)
            irqs = format_cpulist(o.irq for o in bound)
            log.info(
                "irq bound %s",
                format_fields(
                    rank=label,
                    irqs=irqs or None,
                    cpus=cpus,
                    owners=",".join(sorted({a.owner for a in assignments})),
                    skipped=len(done) - len(bound),
                ),
            )
            if bound:
                self._post(
                    self.store.emit,
                    "irq",
                    key,
                    f"{label}: IRQs {irqs} on CPUs {cpus}",
                    irqs=[o.irq for o in bound],
                    cpus=list(assignments[0].cpus),
                    owners=sorted({a.owner for a in assignments}),
                )
        return tuple(outcomes)

    def _bind_one(self, key: ProcKey, a: IrqAssignment) -> IrqOutcome:
        """One write; Denied turns binding off, other refusals skip the IRQ."""
        try:
            effective = self.binder.bind(a.irq, a.cpus)
        except Denied as err:
            self._turn_off(key, a, err)
            return IrqOutcome(key, a.irq, "off", error=str(err))
        except KernelError as err:
            status: IrqStatus = (
                "managed"
                if err.reason == "managed"
                else "gone"
                if err.reason == "gone"
                else "failed"
            )
            # A managed or vanished IRQ is final; any other refusal stays
            # planned, so observe keeps reporting it and the next enforce
            # retries it (the failure is counted once, in _failed).
            self._status[a.irq] = status if status != "failed" else "bound"
            self._failed(key, a, err)
            return IrqOutcome(key, a.irq, status, error=str(err))
        self._status[a.irq] = "bound"
        self._moved.pop(a.irq, None)
        return IrqOutcome(key, a.irq, "bound", tuple(sorted(effective)))

    def _failed(self, key: ProcKey, a: IrqAssignment, err: KernelError) -> None:
        """Count and report a refused IRQ once per (IRQ, reason); later refusals are quiet."""
        if (a.irq, err.reason) in self._reported:
            return
        self._reported.add((a.irq, err.reason))
        label = key_label(key)
        # A managed IRQ is the kernel spreading a multi-queue device's vectors
        # itself (Documentation/core-api/irq/managed_irq.rst): expected, skipped.
        why = "kernel-managed" if err.reason == "managed" else err.errno_name
        self._post_bind_failed(
            key, a, err, f"{label}: irq {a.irq} ({a.owner}) not bound: {why}", owner=a.owner
        )
        log.warning(
            "irq bind failed %s",
            format_fields(
                rank=label, irq=a.irq, owner=a.owner, reason=err.reason, errno=err.errno_name,
                action="skip",
            ),
        )  # fmt: skip

    def _turn_off(self, key: ProcKey, a: IrqAssignment, err: KernelError) -> None:
        # A container's /proc is usually mounted read-only (Docker, Kubernetes
        # without privileged mode): every write would fail the same way, so say
        # it once and stop trying for this run.
        self._off_reason = str(err)
        label = key_label(key)
        self._post_bind_failed(
            key,
            a,
            err,
            f"IRQ binding off for this run: irq {a.irq}: {err.errno_name} "
            "(/proc/irq is read-only or we lack privilege)",
        )
        log.warning(
            "irq binding off %s",
            format_fields(
                rank=label, irq=a.irq, errno=err.errno_name, action="disable irq binding"
            ),
        )

    def _post_bind_failed(
        self, key: ProcKey, a: IrqAssignment, err: KernelError, message: str, **fields: object
    ) -> None:
        """Count a refused IRQ bind and emit its `bind_failed` event (safe from a pool thread)."""
        self._post(self.store.count, "bind_failures", (key_label(key), "irq", err.reason))
        self._post(
            self.store.emit,
            "bind_failed",
            key,
            message,
            target="irq",
            reason=err.reason,
            irq=a.irq,
            **fields,
            errno=err.errno_name,
        )

    # -- irqbalance ---------------------------------------------------------------

    def _coordinate_irqbalance(self) -> None:
        """Detect irqbalance; in "ban" mode ask it to leave our bound IRQs alone.

        It is never stopped: it keeps balancing everything else. When its
        socket does not answer (built without it, another mount namespace),
        drift detection reports each move instead.
        """
        info = detect_irqbalance(self.fs)
        changed = info != self._irqbalance
        self._irqbalance = info
        if info is None:
            if changed:
                self._banned, self._banned_before = frozenset(), None
            return
        ours = frozenset(self.planned_irqs())
        if self.config.irqbalance != "ban" or not ours:
            if changed:
                log.info(
                    "irqbalance running %s",
                    format_fields(pid=info.pid, action="observe: report each move as drift"),
                )
            return
        if not changed and ours == self._banned:
            return
        # The ban command replaces irqbalance's whole socket list: keep what
        # others banned through it, and give exactly that back on restore.
        before = None if changed else self._banned_before
        if before is None:
            before = read_banned_irqs(info)
        if before is None or not ban_irqs(info, before | ours):
            self._banned = frozenset()
            log.warning(
                "irqbalance socket unreachable %s",
                format_fields(
                    pid=info.pid, socket=info.socket_path or "@abstract",
                    action="observe: report each move as drift",
                ),
            )  # fmt: skip
            self._post(
                self.store.emit,
                "irqbalance",
                None,
                f"irqbalance (pid {info.pid}) is running and its socket does not answer: "
                "it may move our IRQs; each move is reported as drift",
                pid=info.pid,
                banned=False,
            )
            return
        self._banned_before = before
        self._banned = ours
        log.info(
            "irqbalance ban %s",
            format_fields(pid=info.pid, irqs=format_cpulist(ours), action="ban via socket"),
        )
        self._post(
            self.store.emit,
            "irqbalance",
            None,
            f"irqbalance (pid {info.pid}) asked to leave IRQs {format_cpulist(ours)} alone",
            pid=info.pid,
            banned=True,
            irqs=sorted(ours),
        )

    # -- observe and enforce -------------------------------------------------------

    def observe(self) -> Mapping[ProcKey, tuple[IrqObservation, ...]]:
        """Where each rank's IRQs are delivered now, with the planned CPUs.

        `planned` is empty for an IRQ we do not keep (managed, refused, or
        binding off), so drift.diff skips it; the API still shows where it is.
        An IRQ newly seen off its CPUs is reported once per move with an event
        naming irqbalance when it runs and is not told to keep off.
        Blocking; call from the executor.
        """
        if not self.config.enabled:
            return MappingProxyType({})
        out: dict[ProcKey, tuple[IrqObservation, ...]] = {}
        with self._lock:
            for key, assignments in self._plan.items():
                obs: list[IrqObservation] = []
                for a in assignments:
                    cpus = read_irq_delivery(self.fs, a.irq) or ()
                    kept = self._off_reason is None and self._status.get(a.irq) == "bound"
                    planned = a.cpus if kept else ()
                    obs.append(IrqObservation(a.irq, cpus, planned))
                    if kept and cpus:
                        self._note_move(key, a, cpus)
                out[key] = tuple(obs)
        return MappingProxyType(out)

    def _note_move(self, key: ProcKey, a: IrqAssignment, cpus: tuple[int, ...]) -> None:
        if set(cpus) <= set(a.cpus):
            self._moved.pop(a.irq, None)
            return
        if self._moved.get(a.irq) == cpus:
            return
        self._moved[a.irq] = cpus
        info = self._irqbalance
        if info is not None and a.irq not in self._banned:
            mover = f"irqbalance (pid {info.pid}) is running and does not keep off it"
        elif info is not None:
            mover = f"irqbalance (pid {info.pid}) was asked to keep off it; someone else"
        else:
            mover = "irqbalance is not running; someone else"
        label = key_label(key)
        self._post(
            self.store.emit,
            "irq_moved",
            key,
            f"{label}: irq {a.irq} ({a.owner}) moved to CPUs {format_cpulist(cpus)}, "
            f"planned {format_cpulist(a.cpus)}: {mover}",
            irq=a.irq,
            cpus=list(cpus),
            planned=list(a.cpus),
            irqbalance=None if info is None else info.pid,
        )
        log.warning(
            "irq moved %s",
            format_fields(
                rank=label, irq=a.irq, cpus=format_cpulist(cpus), planned=format_cpulist(a.cpus),
                irqbalance=None if info is None else info.pid, action="drift finding",
            ),
        )  # fmt: skip

    def enforce(self, key: ProcKey) -> tuple[IrqOutcome, ...]:
        """Re-write the IRQs of `key` that left their planned CPUs (drift policy "enforce").

        Each re-written IRQ counts one rebinds{reason="irq_drift"}. Blocking.
        """
        if not self.enabled:
            return ()
        outcomes: list[IrqOutcome] = []
        with self._lock:
            for a in self._plan.get(key, ()):
                if self._off_reason is not None or self._status.get(a.irq) != "bound":
                    continue
                if not self._drifted(a):
                    continue
                outcome = self._bind_one(key, a)
                outcomes.append(outcome)
                if outcome.status != "bound":
                    continue
                label = key_label(key)
                if self._count_rebinds:
                    self._post(self.store.count, "rebinds", (label, "irq_drift"))
                self._post(
                    self.store.emit,
                    "rebind",
                    key,
                    f"{label}: irq {a.irq} put back on CPUs {format_cpulist(a.cpus)}",
                    irq=a.irq,
                    cpus=list(a.cpus),
                    reason="irq_drift",
                )
                log.info(
                    "irq rebind %s",
                    format_fields(
                        rank=label, irq=a.irq, cpus=format_cpulist(a.cpus), reason="irq_drift"
                    ),
                )
            if outcomes:
                # A restarted irqbalance has a new pid and an empty socket ban list.
                self._coordinate_irqbalance()
        return tuple(outcomes)

    def _drifted(self, a: IrqAssignment) -> bool:
        """Drift by the rule drift.diff uses: delivered outside the planned CPUs.
        An IRQ narrowed within them (by irqbalance, say) is left alone; None
        (the IRQ is gone) is nothing to put back."""
        delivery = read_irq_delivery(self.fs, a.irq)
        return delivery is not None and not set(delivery) <= set(a.cpus)

    # -- replan and restore -----------------------------------------------------------

    def replan(
        self, placement: Placement, topology: Topology | None = None
    ) -> tuple[IrqOutcome, ...]:
        """Re-target every IRQ after a new placement (a cpuset change) and apply it.

        IRQs no longer planned get their original affinity back. Blocking.
        """
        if topology is not None:
            self.topology = topology
        new_plan = plan_irqs(self.topology, placement, nic=self.config.nic)
        with self._lock:
            keep = {a.irq for assignments in new_plan.values() for a in assignments}
            for irq in sorted(self.binder.touched):
                if irq not in keep:
                    self._restore_one(irq)
            self._plan = new_plan
            self._status = {irq: s for irq, s in self._status.items() if irq in keep}
            if not self.enabled:
                return ()
            outcomes = self._apply_locked()
            self._coordinate_irqbalance()
        return outcomes

    def _restore_one(self, irq: int) -> None:
        try:
            self.binder.restore(irq)
        except KernelError as err:
            log.warning("irq restore failed %s", format_fields(irq=irq, error=err, action="leave"))
        self._status.pop(irq, None)

    def restore(self) -> list[tuple[int, KernelError | None]]:
        """Put every IRQ we changed back and give irqbalance its old ban list (best effort).

        One (irq, error or None) per IRQ; each failure is logged, none raised.
        Blocking; the daemon calls it after the processes stopped.
        """
        with self._lock:
            info = self._irqbalance
            if info is not None and self._banned:
                before = self._banned_before or frozenset()
                if not ban_irqs(info, before):
                    log.warning(
                        "irqbalance unban failed %s",
                        format_fields(pid=info.pid, irqs=format_cpulist(self._banned)),
                    )
                self._banned = frozenset()
            results = self.binder.restore_all()
            failed = 0
            for irq, err in results:
                self._status.pop(irq, None)
                if err is not None and err.reason != "gone":
                    failed += 1
                    log.warning(
                        "irq restore failed %s", format_fields(irq=irq, error=err, action="leave")
                    )
            if results:
                restored = [irq for irq, err in results if err is None]
                log.info(
                    "irq restored %s",
                    format_fields(irqs=format_cpulist(restored) or None, failed=failed),
                )
                self._post(
                    self.store.emit,
                    "irq_restored",
                    None,
                    f"IRQs {format_cpulist(restored) or '-'} back on their original CPUs"
                    + (f"; {failed} failed" if failed else ""),
                    irqs=restored,
                    failed=failed,
                )
        return results

    # -- store writes from any thread ------------------------------------------------

    def _post(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or _running_loop() is loop:
            fn(*args, **kwargs)
            return
        try:
            loop.call_soon_threadsafe(lambda: fn(*args, **kwargs))
        except RuntimeError:  # the loop closed between the check and the call
            fn(*args, **kwargs)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
