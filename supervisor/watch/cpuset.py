"""The re-plan after a change of the supervisor's allowed set (on the loop; its reads
in the executor).

`Replanning.replan(allowed)` re-reads what a cpuset write or a CPU hotplug
can change (CPUs, nodes, the allowed set: its `read_topology`, never PCI,
NICs or /proc/interrupts) and plans again under the settings in force
(supervisor.plan.replan, degrading on_shortage as far as "share"). It
returns the new plan; the check loop puts it in force through its one
install step (supervisor.in_force, then the IRQs and cgroups) and its
next decide/apply handles the moved processes with cause "cpuset_changed".
A failed re-plan keeps the old plan and is retried every pass (`pending`),
said once per distinct reason.

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

from supervisor.config import DriftConfig
from supervisor.cpulist import format_cpulist
from supervisor.errors import SupervisorError
from supervisor.events import Recorder
from supervisor.in_force import Moved, PlanInForce
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.replan import AllowedSet, Replan, mems_changed, replan, same_processes
from supervisor.state import ProcessStatus
from supervisor.topology.model import Topology
from supervisor.watch.policy import Policy


class Replanning:
    """Re-plans for the check loop; `pending` while the last re-plan failed."""

    def __init__(
        self,
        read_topology: Callable[[Topology], Topology],
        *,
        plan: PlanInForce,
        executor: Executor,
        record: Recorder,
    ) -> None:
        self.read_topology = read_topology  # blocking: the executor
        self.plan = plan
        self.executor = executor
        self.record = record
        self.pending = False
        self._said: str | None = None

    async def replan(self, allowed: AllowedSet) -> Replan | None:
        """A plan for `allowed` (the topology re-read); None when the old one stays."""
        loop = asyncio.get_running_loop()
        old = self.plan
        try:
            fresh = await loop.run_in_executor(self.executor, self.read_topology, old.topology)
            result = replan(fresh, old.config.placement)
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
                "plan",
                None,
                text,
                log_message="replan degraded",
                level=logging.WARNING,
                warning=True,
                on_shortage=result.shortage,
            )
        self.pending, self._said = False, None
        return result

    def replanned(self, result: Replan, moved: Moved) -> None:
        """The event of a re-plan put in force."""
        self.record.note(
            "plan",
            None,
            f"re-planned for cpus {format_cpulist(result.topology.allowed.cpus)}: "
            f"{', '.join(key_label(k) for k in moved.keys) or 'no process'} moved",
            moved=[key_label(k) for k in moved.keys],
            warnings=list(result.placement.warnings),
            shared=result.placement.shared,
        )

    def _keep_plan(self, why: str, *, retry: bool = True) -> None:
        # Retried every pass until it succeeds (a read racing a hotplug, say);
        # said once per distinct reason, not once per pass.
        self.pending = retry
        if why == self._said:
            return
        self._said = why
        self.record.note(
            "plan_failed",
            None,
            f"re-plan failed: {why}; keeping the old plan",
            log_message="replan failed",
            level=logging.ERROR,
            error=why,
            action="keep old plan, retry",
        )


def moved_policies(
    drift: DriftConfig,
    topology: Topology,
    processes: Mapping[ProcKey, ProcessStatus],
    moved: Moved,
) -> dict[ProcKey, Policy]:
    """The cause "cpuset_changed" policy of each process a new plan moved (pure):
    its pages move when its nodes changed and no cgroup of its own moves them."""
    node_ids = tuple(n.id for n in topology.nodes)
    out: dict[ProcKey, Policy] = {}
    for key in moved.keys:
        status = processes.get(key)
        if status is None:
            continue
        in_cgroup = status.cgroup is not None and key not in moved.cgroup_failed
        out[key] = Policy.of(
            drift,
            "cpuset_changed",
            move_memory=mems_changed(moved.old, moved.new, key) and not in_cgroup,
            node_ids=node_ids,
        )
    return out
