"""The steady state of one process: a pass that would decide nothing again (pure).

Most passes of a healthy host find every thread on its CPUs, memory local and
the cgroup as made, and decide, bind and record nothing. When the last pass of
a process did exactly that (`mark_of`) and this pass saw the same thing (the
scanner's very threads tuple, equal memory, IRQs and cgroup, the same slot,
policy and repair state), deciding again would give the same empty decision:
`SteadyMark.holds` says so and the loop publishes the fresh observation
without deciding, settling or recording (issue 17, item 6: that was a third
of a quiet pass's work on the loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from supervisor.plan.placement import Slot
from supervisor.state import Observation
from supervisor.watch.decide import Decision, RepairState, has_work
from supervisor.watch.policy import Policy
from supervisor.watch.settle import Settled


@dataclass(frozen=True, slots=True)
class SteadyMark:
    """What a process's last, empty pass started from."""

    slot: Slot
    policy: Policy
    state: RepairState  # the state that pass left: the same object while nothing changed it
    observation: Observation
    summary: dict[str, Any]  # its answer (publish.summary_of): the same for the same pid

    def holds(self, slot: Slot, policy: Policy, state: RepairState, obs: Observation) -> bool:
        last = self.observation
        return (
            state is self.state
            and policy is self.policy
            and obs.threads is last.threads
            and obs.local_memory_ratio == last.local_memory_ratio
            and obs.memory_bytes_by_node == last.memory_bytes_by_node
            and obs.irqs == last.irqs
            and obs.cgroup == last.cgroup
            and (slot is self.slot or slot == self.slot)
        )


def mark_of(
    d: Decision, s: Settled, slot: Slot, policy: Policy, summary: dict[str, Any]
) -> SteadyMark | None:
    """A mark when the pass found, did and failed nothing and left no repair or
    migration under way (nothing `decide` would look at the clock or at other
    processes for); else None."""
    st = s.state
    if (
        policy.cause != "check"
        or d.findings
        or d.notes
        or has_work(d)
        or s.failures
        or st.reported
        or st.repairing
        or st.memory_stale
        or st.migrated_from is not None
    ):
        return None
    return SteadyMark(slot, policy, st, d.observation, summary)
