"""The re-plan after a change of the supervisor's allowed set (on the loop; its reads
and writes in the executor).

`Replanning.replan(allowed)` re-reads what a cpuset write or a CPU hotplug
can change (CPUs, nodes, the allowed set: `Replanner.read_topology`, never
PCI, NICs or /proc/interrupts), plans again (supervisor.plan.replan, degrading
on_shortage as far as "share"), installs the plan, re-targets the IRQs and
sets the instance and moved processes' cgroups. It returns what moved; the
check loop then sends those processes through its own scan -> decide ->
apply with cause "cpuset_changed". A failed re-plan keeps the old plan and is
retried every pass (`pending`), said once per distinct reason.

cgroup v1 note: the kernel refuses (EBUSY) to shrink a v1 cpuset below the
CPUs of any child cpuset (Documentation/admin-guide/cgroup-v1/cpusets.rst),
and the per-rank cgroups are children of the supervisor's. Whoever shrinks
the supervisor's v1 cpuset must shrink its descendants first, as container
runtimes do; the daemon then re-plans and sets each rank's cgroup to its new
slot. On v1 every cpuset write resets the affinity of the cgroup's tasks to
the whole new set; cgroup v2 since Linux 6.2 keeps a task's own affinity
where it still fits. Either way the loop re-applies the thread roles after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

from supervisor.cpulist import format_cpulist
from supervisor.errors import KernelError, SupervisorError
from supervisor.events import Recorder
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Placement, PlanSettings, Slot
from supervisor.plan.replan import AllowedSet, changed_keys, replan, same_processes, slots_by_key
from supervisor.state import StateStore
from supervisor.topology.model import Topology
from supervisor.watch.apply import Applier
from supervisor.watch.scan import IrqKeeperLike


@dataclass(frozen=True, slots=True)
class Replanner:
    """What a re-plan needs: a fresh read of what a cpuset change can change (CPUs,
    nodes, the allowed set; blocking), the plan settings, and where the plan goes."""

    read_topology: Callable[[Topology], Topology]
    settings: PlanSettings
    install: Callable[[Placement, Topology], None]


@dataclass(frozen=True, slots=True)
class Moved:
    """A new plan in force, and which processes it moved."""

    old: Placement
    new: Placement
    keys: tuple[ProcKey, ...]
    cgroup_failed: Mapping[ProcKey, KernelError]  # their cgroup kept its old set

    def slot(self, key: ProcKey, *, old: bool = False) -> Slot:
        return slots_by_key(self.old if old else self.new)[key]


class Replanning:
    """Re-plans for the check loop; `pending` while the last re-plan failed."""

    def __init__(
        self,
        replanner: Replanner,
        *,
        executor: Executor,
        store: StateStore,
        irqs: IrqKeeperLike | None,
        applier: Applier,
        record: Recorder,
    ) -> None:
        self.replanner = replanner
        self.executor = executor
        self.store = store
        self.irqs = irqs
        self.applier = applier
        self.record = record
        self.pending = False
        self._said: str | None = None

    async def replan(self, allowed: AllowedSet) -> Moved | None:
        """Plan for `allowed` and put the plan in force; None when the old one stays."""
        loop = asyncio.get_running_loop()
        old = self.store.snapshot
        try:
            fresh = await loop.run_in_executor(
                self.executor, self.replanner.read_topology, old.topology
            )
            result = replan(fresh, self.replanner.settings)
        except SupervisorError as err:
            self._keep_plan(f"{err}")
            return None
        if not same_processes(old.placement, result.placement):
            # Not a passing fault: retrying cannot change which devices exist.
            self._keep_plan("the new plan holds other processes than the running ones", retry=False)
            return None
        if result.shortage is not None:
            text = (
                f"the new cpuset cannot hold the plan's minimums; planned with "
                f"on_shortage={result.shortage} ({'; '.join(result.degraded)})"
            )
            self.record.note(
                "plan", None, text, log_message="replan degraded", level=logging.WARNING,
                warning=True, on_shortage=result.shortage,
            )  # fmt: skip
        moved = changed_keys(old.placement, result.placement)
        self.replanner.install(result.placement, result.topology)
        self.pending, self._said = False, None
        self.record.note(
            "plan",
            None,
            f"re-planned for cpus {format_cpulist(result.topology.allowed.cpus)}: "
            f"{', '.join(key_label(k) for k in moved) or 'no process'} moved",
            moved=[key_label(k) for k in moved],
            warnings=list(result.placement.warnings),
            shared=result.placement.shared,
        )
        if self.irqs is not None:
            try:
                await loop.run_in_executor(self.executor, self.irqs.replan, result.placement)
            except Exception as irq_err:  # IRQs degrade alone
                text = f"IRQ re-plan failed: {irq_err}"
                self.record.bind_failed(None, "irq", "error", text, action="degrade")
            self.record.facts(self.irqs.take_facts())
        failed = await loop.run_in_executor(
            self.executor,
            self.applier.update_cgroups,
            allowed,
            slots_by_key(result.placement),
            moved,
        )
        per_key: dict[ProcKey, KernelError] = {}
        for key, cgroup_err in failed:
            if key is None:
                text = f"instance cgroup update failed: {cgroup_err}"
                self.record.bind_failed(None, "cgroup", "error", text, action="degrade")
            else:
                per_key[key] = cgroup_err
        return Moved(old.placement, result.placement, moved, per_key)

    def _keep_plan(self, why: str, *, retry: bool = True) -> None:
        # Retried every pass until it succeeds (a read racing a hotplug, say);
        # said once per distinct reason, not once per pass.
        self.pending = retry
        if why == self._said:
            return
        self._said = why
        self.record.note(
            "plan_failed", None, f"re-plan failed: {why}; keeping the old plan",
            log_message="replan failed", level=logging.ERROR, error=why,
            action="keep old plan, retry",
        )  # fmt: skip
