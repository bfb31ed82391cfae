"""The plan: which CPUs, roles and memory nodes each process gets (no I/O).

`supervisor.plan.planner.plan()` produces a `Placement`; `to_doc()` renders the plan
document of docs/contracts.md §3 (the `plan --json` output and the base of
`GET /placement`). `from_doc()` reads it back (the `status` command, tests).
A rank's planned IRQs (`RankPlacement.irqs`, from supervisor.plan.irqs) are
part of the plan; the document lists them as "irqs" only where there are some.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from supervisor.topology.accelerators import DeviceKind

PLAN_VERSION = 1
Strategy = Literal["numa-affine", "global-slice", "topo-affinity", "mixed", "shared"]
IrqSource = Literal["device", "nic"]


@dataclass(frozen=True, slots=True)
class DeviceRef:
    """The device a rank drives, as the plan document names it (`uuid`, NVIDIA's
    "GPU-...", only when known: the document carries it only then)."""

    kind: DeviceKind
    index: int
    bus_id: str | None
    numa_node: int | None
    uuid: str | None = None

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "kind": self.kind,
            "index": self.index,
            "bus_id": self.bus_id,
            "numa_node": self.numa_node,
        }
        if self.uuid is not None:
            doc["uuid"] = self.uuid
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> DeviceRef:
        return cls(
            doc["kind"], int(doc["index"]), doc.get("bus_id"), doc.get("numa_node"), doc.get("uuid")
        )


@dataclass(frozen=True, slots=True)
class IrqAssignment:
    """One IRQ a rank owns and the CPUs it should be delivered to."""

    irq: int
    cpus: tuple[int, ...]  # the rank's `irq` role CPUs, sorted
    source: IrqSource  # the rank's own device, or its paired NIC
    owner: str  # "nvidia0", "pci0", or the NIC's name ("mlx5_0")
    bdf: str | None
    name: str = ""  # the /proc/interrupts action ("mlx5_comp3@pci:0000:18:00.0")

    def to_doc(self) -> dict[str, Any]:
        return {
            "irq": self.irq,
            "cpus": list(self.cpus),
            "source": self.source,
            "owner": self.owner,
            "bdf": self.bdf,
            "name": self.name,
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> IrqAssignment:
        return cls(
            int(doc["irq"]),
            tuple(doc["cpus"]),
            doc["source"],
            str(doc["owner"]),
            doc.get("bdf"),
            str(doc.get("name", "")),
        )


@dataclass(frozen=True, slots=True)
class Slot:
    """CPUs, memory nodes and roles of one process (the engine or a rank).

    `roles` partitions `cpus` unless the plan shares CPUs (then it says so in
    the placement's warnings). `main` holds every CPU no other role claims.
    """

    cpus: tuple[int, ...]
    mems: tuple[int, ...]
    roles: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def role_cpus(self, role: str) -> tuple[int, ...]:
        """The CPUs of `role`, falling back to `main` (a merged or absent role)."""
        return self.roles.get(role) or self.roles.get("main") or self.cpus

    def to_doc(self) -> dict[str, Any]:
        return {
            "cpus": list(self.cpus),
            "mems": list(self.mems),
            "roles": {name: list(cpus) for name, cpus in self.roles.items()},
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Slot:
        return cls(
            tuple(doc["cpus"]),
            tuple(doc["mems"]),
            {str(k): tuple(v) for k, v in doc.get("roles", {}).items()},
        )


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """One worker rank: its device(s), its slot and the IRQs it owns.

    `irqs` is the IRQ plan of this rank (supervisor.plan.irqs.plan_irqs), by
    IRQ number; empty when IRQ binding is off or its devices have none. The
    IRQ keeper (supervisor.watch.irqs) writes and checks exactly these.
    """

    rank: int
    device: DeviceRef
    slot: Slot
    local_rank: int = 0
    devices: tuple[DeviceRef, ...] = ()  # every device of the rank when it drives several
    strategy: Strategy = "numa-affine"
    irqs: tuple[IrqAssignment, ...] = ()
    # The L3 domains its CPUs lie in, each named by its lowest CPU (the
    # document's "l3_domains"); empty where the host does not say.
    l3_domains: tuple[int, ...] = ()

    @property
    def all_devices(self) -> tuple[DeviceRef, ...]:
        return self.devices or (self.device,)

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"rank": self.rank, "local_rank": self.local_rank}
        doc["device"] = self.device.to_doc()
        if len(self.all_devices) > 1:
            doc["devices"] = [d.to_doc() for d in self.all_devices]
        doc.update(self.slot.to_doc())
        doc["strategy"] = self.strategy
        if self.l3_domains:
            doc["l3_domains"] = list(self.l3_domains)
        if self.irqs:
            doc["irqs"] = [a.to_doc() for a in self.irqs]
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> RankPlacement:
        return cls(
            rank=int(doc["rank"]),
            device=DeviceRef.from_doc(doc["device"]),
            slot=Slot.from_doc(doc),
            local_rank=int(doc.get("local_rank", 0)),
            devices=tuple(DeviceRef.from_doc(d) for d in doc.get("devices", ())),
            strategy=doc.get("strategy", "numa-affine"),
            irqs=tuple(IrqAssignment.from_doc(a) for a in doc.get("irqs", ())),
            l3_domains=tuple(int(n) for n in doc.get("l3_domains", ())),
        )


@dataclass(frozen=True, slots=True)
class Placement:
    """The whole plan. `engine` is None when the config runs no engine.

    `engine_node` is the node the engine sits on when the planner put it on a
    node with no device (SNC hosts), None when it shares rank 0's node or
    slice; the document carries it as "engine_node" only when set.
    """

    strategy: Strategy
    engine: Slot | None
    ranks: tuple[RankPlacement, ...]
    warnings: tuple[str, ...] = ()
    shared: bool = False  # True when some CPUs serve more than one process (tiny hosts)
    engine_node: int | None = None

    @property
    def has_irqs(self) -> bool:
        """Some rank has IRQs to bind (`RankPlacement.irqs`, from [irq] and the devices)."""
        return any(r.irqs for r in self.ranks)

    def rank(self, rank: int) -> RankPlacement:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(rank)

    def slot(self, key: int | Literal["engine"]) -> Slot:
        """The slot of a rank number, or of "engine"."""
        if key == "engine":
            if self.engine is None:
                raise KeyError("engine")
            return self.engine
        return self.rank(key).slot

    def to_doc(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "strategy": self.strategy,
            "engine": None if self.engine is None else self.engine.to_doc(),
            "ranks": [r.to_doc() for r in self.ranks],
            "warnings": list(self.warnings),
            "shared": self.shared,
        } | ({} if self.engine_node is None else {"engine_node": self.engine_node})

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Placement:
        if doc.get("version") != PLAN_VERSION:
            raise ValueError(f"plan document version {doc.get('version')!r}, expected 1")
        engine = doc.get("engine")
        return cls(
            strategy=doc["strategy"],
            engine=None if engine is None else Slot.from_doc(engine),
            ranks=tuple(RankPlacement.from_doc(r) for r in doc["ranks"]),
            warnings=tuple(doc.get("warnings", ())),
            shared=bool(doc.get("shared", False)),
            engine_node=None if doc.get("engine_node") is None else int(doc["engine_node"]),
        )


StrategySetting = Literal["auto", "numa-affine", "global-slice"]
Allocator = Literal["supervisor", "topo_affinity", "global_slice"]
"""`supervisor`: this planner's own (whole cores, engine slot); the others are
the vLLM-Ascend CPU binding document's allocators (supervisor.plan.document)."""
Shortage = Literal["error", "merge", "share"]


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """What the planner is asked for (the `[placement]` table of the config).

    Role sizes are in CPUs; a role's CPUs are whole physical cores where the
    host has SMT (a 1-CPU role on an SMT host takes one core's threads).
    `main` always gets every CPU of the slot that no other role claims.
    """

    strategy: StrategySetting = "auto"
    allocator: Allocator = "supervisor"
    rank_roles: Mapping[str, int] = field(default_factory=lambda: {"irq": 1, "comm": 1})
    min_main_cpus: int = 1
    engine: bool = True
    engine_main_cpus: int = 2
    engine_roles: Mapping[str, int] = field(default_factory=lambda: {"so_compiler": 4})
    reserve_hidden: bool = True  # hidden devices on the same node keep their share
    # error: PlanError on too few CPUs; merge: fold roles into main, with a
    # warning; share: merge, then let processes share CPUs, with a warning.
    # None: "share" on a host without accelerators (the demo), else "error".
    on_shortage: Shortage | None = None
    devices_per_rank: int = 1
    # The `[irq]` table's part in the plan: plan the devices' IRQs onto each
    # rank's `irq` role (`enabled`), and those of its nearest NIC too (`nic`).
    irqs: bool = True
    irq_nic: bool = False
