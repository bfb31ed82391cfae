"""Drift: what differs between the plan and live state, and what to do about it (pure).

`diff()` compares one process's `Observation` with its `Slot` and returns
`Finding`s (thread_affinity, self_rebind, memory_locality, irq_affinity,
process_gone);
`diff_allowed()` compares the supervisor's allowed CPUs/nodes between two
checks (cpuset_changed, host-wide). `apply_policy()` marks each finding
"observe" or "enforce" per the config's `[drift.policy]`. No I/O: the daemon
observes (supervisor.watch.observe), diffs here, then applies through the binder.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Literal

from supervisor.cpulist import format_cpulist
from supervisor.plan.placement import Slot
from supervisor.plan.threads import thread_verdict
from supervisor.state import DriftKind, Finding, Observation

PolicyAction = Literal["observe", "enforce"]


def diff(
    slot: Slot,
    observation: Observation | None,
    *,
    threshold: float,
    pinned_ok: bool = True,
    process_alive: bool = True,
) -> tuple[Finding, ...]:
    """Findings for one process (the engine or a rank), all with action "observe".

    - process_gone: `process_alive` is False (then nothing else is checked).
    - thread_affinity: a thread's live CPUs differ from its role's CPUs
      (`slot.role_cpus(thread.role)`), unless the workload pinned it to a
      strict subset of them and `pinned_ok` (config `enforce_pinned = false`).
      target "tid <tid>", expected/actual as CPU lists.
    - self_rebind: every thread on the same CPUs outside the slot (the process
      bound itself; see `_self_rebind`), instead of their thread_affinity.
    - memory_locality: the local memory ratio is below `threshold`.
    - irq_affinity: an IRQ's effective CPUs are not within its planned CPUs
      (an IRQ observed with no CPUs is gone and skipped). target "irq <n>".
    """
    if not process_alive:
        return (Finding("process_gone", "process", "running", "exited"),)
    if observation is None:
        return ()
    findings: list[Finding] = []
    wanted: dict[str, tuple[int, ...]] = {}
    for thread in observation.threads:
        want = wanted.get(thread.role)
        if want is None:
            want = wanted[thread.role] = tuple(sorted(set(slot.role_cpus(thread.role))))
        # Both sides sorted: the common "on its CPUs" case is one tuple compare.
        if thread.cpus != want and thread_verdict(thread.cpus, want, not pinned_ok) == "drift":
            findings.append(
                Finding(
                    "thread_affinity",
                    f"tid {thread.tid}",
                    format_cpulist(want),
                    format_cpulist(thread.cpus),
                )
            )
    findings = _self_rebind(slot, observation, findings)
    ratio = observation.local_memory_ratio
    if ratio is not None and ratio < threshold:
        findings.append(
            Finding(
                "memory_locality",
                "memory",
                f">={threshold:.2f} on node {format_cpulist(slot.mems)}",
                f"{ratio:.3f} ({_bytes_by_node(observation.memory_bytes_by_node)})",
            )
        )
    for irq in observation.irqs:
        if irq.cpus and irq.planned and not set(irq.cpus) <= set(irq.planned):
            findings.append(
                Finding(
                    "irq_affinity",
                    f"irq {irq.irq}",
                    format_cpulist(irq.planned),
                    format_cpulist(irq.cpus),
                )
            )
    return tuple(findings)


def _self_rebind(slot: Slot, obs: Observation, findings: list[Finding]) -> list[Finding]:
    """thread_affinity findings that are one process moving itself out of its slot.

    When every thread sits on the same CPUs and they are not inside the slot,
    the process bound itself as a whole (vLLM --numa-bind, SGLang's numactl
    wrapper, torchrun --numa-binding, a sched_setaffinity before its threads
    started): `self_rebind`, fixed or left by its own policy. A single thread
    off its role stays thread_affinity; narrowing inside the slot is "pinned"
    and never a finding (pinned_ok). Who made the change the kernel does not say.
    """
    if not obs.threads or len(findings) != len(obs.threads):
        return findings
    cpus = {t.cpus for t in obs.threads}
    if len(cpus) != 1 or set(next(iter(cpus))) <= set(slot.cpus):
        return findings
    return [replace(f, kind="self_rebind") for f in findings]


def cpuset_changed(
    old_cpus: Iterable[int],
    old_mems: Iterable[int],
    new_cpus: Iterable[int],
    new_mems: Iterable[int],
) -> bool:
    """True when the allowed CPUs or memory nodes differ (as sets)."""
    return set(old_cpus) != set(new_cpus) or set(old_mems) != set(new_mems)


def diff_allowed(
    old_cpus: Iterable[int],
    old_mems: Iterable[int],
    new_cpus: Iterable[int],
    new_mems: Iterable[int],
) -> tuple[Finding, ...]:
    """A cpuset_changed finding when the supervisor's allowed set changed.

    Pass the allowed CPUs intersected with the online CPUs to catch hotplug
    too. Host-wide: the daemon calls this once per check and re-plans on it.
    """
    old_c, old_m, new_c, new_m = set(old_cpus), set(old_mems), set(new_cpus), set(new_mems)
    if not cpuset_changed(old_c, old_m, new_c, new_m):
        return ()
    return (
        Finding(
            "cpuset_changed",
            "cpuset",
            f"cpus {format_cpulist(old_c)} mems {format_cpulist(old_m)}",
            f"cpus {format_cpulist(new_c)} mems {format_cpulist(new_m)}",
        ),
    )


def apply_policy(
    findings: Iterable[Finding], policy: Mapping[str, PolicyAction]
) -> tuple[Finding, ...]:
    """The findings with `action` set from `policy` (by kind; absent -> "observe")."""
    out: list[Finding] = []
    for finding in findings:
        action: PolicyAction = policy.get(finding.kind, "observe")
        out.append(finding if finding.action == action else replace(finding, action=action))
    return tuple(out)


def target_id(finding: Finding) -> int | None:
    """The tid or IRQ number of a thread_affinity / irq_affinity finding, else None."""
    kind, _, number = finding.target.partition(" ")
    if kind in ("tid", "irq") and number.isdigit():
        return int(number)
    return None


def kinds(findings: Iterable[Finding]) -> dict[DriftKind, int]:
    """How many findings of each kind (for `placement_drift_events_total`)."""
    counts: dict[DriftKind, int] = {}
    for finding in findings:
        counts[finding.kind] = counts.get(finding.kind, 0) + 1
    return counts


def _bytes_by_node(by_node: Mapping[int, int]) -> str:
    mib = 1 << 20
    return " ".join(f"node{node}={size // mib}MiB" for node, size in sorted(by_node.items()))
