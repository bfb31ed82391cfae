"""The plan in force: the one holder of the config, topology and placement the daemon
runs by (pure data, no I/O; one writer: the event loop's check loop).

Runners build each spawn's spec from it, the IRQ keeper is handed its placement
per call, the check loop checks against it and the API shows it (the loop
publishes it to the snapshot in the same step). `install` puts a new plan in
force (a cpuset change's re-plan, a config reload) and returns `Moved`: which
processes' slots changed and which ranks' IRQ plans did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from supervisor.config import Config
from supervisor.errors import KernelError, PlanError
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Placement, Slot
from supervisor.plan.replan import changed_keys, same_processes, slots_by_key
from supervisor.topology.model import Topology

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Moved:
    """A new plan put in force: the old and new placements and what changed between them."""

    old: Placement
    new: Placement
    keys: tuple[ProcKey, ...]  # processes whose CPUs, memory nodes or roles changed
    irq_keys: tuple[ProcKey, ...] = ()  # ranks whose planned IRQs changed
    config_changed: bool = False
    # Filled by whoever set the moved processes' cgroups: those that kept their old set.
    cgroup_failed: Mapping[ProcKey, KernelError] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def slot(self, key: ProcKey, *, old: bool = False) -> Slot:
        return slots_by_key(self.old if old else self.new)[key]


def irq_changed_keys(old: Placement, new: Placement) -> tuple[ProcKey, ...]:
    """The ranks whose IRQ assignments differ between two plans (pure)."""
    before = {r.rank: r.irqs for r in old.ranks}
    return tuple(r.rank for r in new.ranks if before.get(r.rank) != r.irqs)


class PlanInForce:
    """The config, topology and placement in force; replaced whole by `install`."""

    def __init__(self, config: Config, topology: Topology, placement: Placement) -> None:
        self._config = config
        self._topology = topology
        self._placement = placement
        self._slots = slots_by_key(placement)
        self.generation = 0  # +1 per install: what a cache of derived specs keys on
        self._derived: dict[Callable[[Config], Any], tuple[Config, Any]] = {}

    def __repr__(self) -> str:
        return f"PlanInForce(generation={self.generation}, processes={len(self._slots)})"

    @property
    def config(self) -> Config:
        return self._config

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def placement(self) -> Placement:
        return self._placement

    def derived(self, make: Callable[[Config], T]) -> T:
        """`make(config in force)`, made again only once another config is in force:
        what a reader builds from the config (a drift policy, role matchers) is read
        at each use, never kept from an older config (one cache entry per `make`)."""
        held = self._derived.get(make)
        if held is None or held[0] is not self._config:
            held = self._derived[make] = (self._config, make(self._config))
        value: T = held[1]
        return value

    def slot(self, key: ProcKey) -> Slot:
        """The slot of `key` in the plan in force (KeyError when it is not planned)."""
        return self._slots[key]

    def install(
        self, placement: Placement, topology: Topology, *, config: Config | None = None
    ) -> Moved:
        """Put `placement` (planned on `topology`, under `config`: the same one when
        None) in force; returns what moved. Raises PlanError, changing nothing,
        when the new plan holds other processes than the one in force: the
        runners are made once, per planned process."""
        old = self._placement
        if not same_processes(old, placement):
            before = sorted(key_label(k) for k in self._slots)
            after = sorted(key_label(k) for k in slots_by_key(placement))
            raise PlanError(
                f"the new plan holds other processes ({', '.join(after)}) than the "
                f"plan in force ({', '.join(before)})"
            )
        moved = Moved(
            old,
            placement,
            changed_keys(old, placement),
            irq_changed_keys(old, placement),
            config is not None and config is not self._config,
        )
        self._placement = placement
        self._topology = topology
        self._slots = slots_by_key(placement)
        if config is not None:
            self._config = config
        self.generation += 1
        return moved
