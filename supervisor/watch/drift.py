"""Drift: what differs between the plan and live state, and what to do about it (pure).

`diff()` compares one process's `Observation` with its `Slot` and returns
`Finding`s (thread_affinity, self_rebind, memory_locality, irq_affinity,
process_gone, cgroup);
`irq_drifted()` is the one IRQ drift rule (the IRQ keeper uses it too).
`apply_policy()` marks each finding "observe" or "enforce" per the config's
`[drift.policy]`. No I/O: supervisor.watch.decide calls these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Literal

from supervisor.cpulist import format_cpulist
from supervisor.plan.placement import Slot
from supervisor.plan.threads import thread_verdict
from supervisor.state import CgroupObservation, Finding, Observation, ThreadObservation

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
    - cgroup: the process's own cgroup differs from what the supervisor made
      (`cgroup_findings`): someone else removed it, rewrote its cpuset, or
      moved the process out.
    """
    if not process_alive:
        return (Finding("process_gone", "process", "running", "exited"),)
    if observation is None:
        return ()
    return thread_findings(slot, observation.threads, pinned_ok=pinned_ok) + process_findings(
        slot, observation, threshold=threshold
    )


def thread_findings(
    slot: Slot, threads: Sequence[ThreadObservation], *, pinned_ok: bool = True
) -> tuple[Finding, ...]:
    """`diff`'s thread_affinity and self_rebind findings: they depend on the slot and
    the threads alone (the check loop reuses them while both are the same objects)."""
    findings: list[Finding] = []
    wanted: dict[str, tuple[int, ...]] = {}
    for thread in threads:
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
    return tuple(_self_rebind(slot, threads, findings))


def process_findings(
    slot: Slot, observation: Observation, *, threshold: float
) -> tuple[Finding, ...]:
    """`diff`'s findings about the process as a whole: its cgroup, memory and IRQs."""
    findings: list[Finding] = []
    if observation.cgroup is not None:
        findings.extend(cgroup_findings(slot, observation.cgroup))
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
        if irq_drifted(irq.cpus, irq.planned):
            findings.append(
                Finding(
                    "irq_affinity",
                    f"irq {irq.irq}",
                    format_cpulist(irq.planned),
                    format_cpulist(irq.cpus),
                )
            )
    return tuple(findings)


def cgroup_findings(slot: Slot, cg: CgroupObservation) -> list[Finding]:
    """What someone else changed in a process's own cgroup (kind "cgroup").

    Targets: "cgroup" (its dirs removed; the process then runs outside the
    instance's cgroups), "cgroup cpuset.cpus" / "cgroup cpuset.mems" (v2: a
    cpuset rewritten, narrower, wider or elsewhere: any difference from the
    slot), "cgroup.procs" (the process moved out of a dir that is still there).
    """
    if cg.missing:
        return [Finding("cgroup", "cgroup", "present", "removed: " + " ".join(cg.missing))]
    out: list[Finding] = []
    for name, want, got in (
        ("cpuset.cpus", slot.cpus, cg.cpus),
        ("cpuset.mems", slot.mems, cg.mems),
    ):
        if got is not None and got != tuple(sorted(set(want))):
            out.append(
                Finding("cgroup", f"cgroup {name}", format_cpulist(want), format_cpulist(got))
            )
    if cg.outside:
        out.append(Finding("cgroup", "cgroup.procs", "in its cgroup", "outside"))
    return out


def irq_drifted(delivered: Iterable[int], planned: Iterable[int]) -> bool:
    """The one IRQ drift rule: delivered outside its planned CPUs. An IRQ
    narrowed within them (by irqbalance, say) is fine; one delivered nowhere
    (gone) or planned nowhere (not ours to keep) is no drift."""
    got, want = set(delivered), set(planned)
    return bool(got) and bool(want) and not got <= want


def _self_rebind(
    slot: Slot, threads: Sequence[ThreadObservation], findings: list[Finding]
) -> list[Finding]:
    """thread_affinity findings that are one process moving itself out of its slot.

    Judged per process of the tree (threads grouped by their `pid`). When
    every thread of one process sits on the same CPUs and they are not inside the slot,
    the process bound itself as a whole (vLLM --numa-bind, SGLang's numactl
    wrapper, torchrun --numa-binding, a sched_setaffinity before its threads
    started): `self_rebind`, fixed or left by its own policy. A single thread
    off its role stays thread_affinity; narrowing inside the slot is "pinned"
    and never a finding (pinned_ok). Who made the change the kernel does not say.
    """
    if not findings:
        return findings
    if all(t.pid is None for t in threads):  # no tree members: one process
        groups: list[Sequence[ThreadObservation]] = [threads]
    else:
        by_pid: dict[int | None, list[ThreadObservation]] = {}
        for t in threads:
            by_pid.setdefault(t.pid, []).append(t)
        groups = list(by_pid.values())
    targets = {f.target for f in findings}
    moved: set[str] = set()
    for group in groups:
        names = [f"tid {t.tid}" for t in group]
        if not all(n in targets for n in names):
            continue
        cpus = {t.cpus for t in group}
        if len(cpus) == 1 and not set(next(iter(cpus))) <= set(slot.cpus):
            moved.update(names)
    if not moved:
        return findings
    return [replace(f, kind="self_rebind") if f.target in moved else f for f in findings]


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


def _bytes_by_node(by_node: Mapping[int, int]) -> str:
    mib = 1 << 20
    return " ".join(f"node{node}={size // mib}MiB" for node, size in sorted(by_node.items()))
