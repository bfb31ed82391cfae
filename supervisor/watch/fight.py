"""Tugs of war with an outside writer over a thread's CPUs or a cgroup (pure, no I/O).

A thread we re-bound that is found off its role's CPUs again at the next pass,
`CONFLICT_AFTER` times running, has a writer outside the daemon (a tuning agent,
a stray `taskset` loop, a second supervisor). Re-binding it once a pass forever
wins nothing (a writer every 10 ms holds the thread 99% of the time) and hides
the fight, so the loop backs off exponentially and reports a `conflict`. A
process's cgroup repair (re-made, its processes put back) fights the same way,
under the target "cgroup".

Who the writer is cannot be read: sched_setaffinity(2) leaves no trace in /proc
of the caller, and no audit or BPF hook is ours to assume. The finding says so
rather than guess from whatever else ran at the time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from supervisor.state import Finding

CONFLICT_AFTER = 3  # re-binds of one thread, each undone by the next pass
BACKOFF_FIRST = 2.0  # check intervals held off after the CONFLICT_AFTER-th re-bind
BACKOFF_MAX = 32.0  # check intervals: the longest hold (doubling from BACKOFF_FIRST)
WRITER_UNKNOWN = "written by another process (its pid is not recorded by the kernel)"


@dataclass(frozen=True, slots=True)
class Fight:
    """One thread's run of re-binds that did not hold (monotonic seconds)."""

    rebinds: int = 0  # consecutive, each found undone at the next pass
    hold_until: float = 0.0  # no re-bind before
    backoff_s: float = 0.0  # the last hold's length; 0 until the conflict begins

    @property
    def conflict(self) -> bool:
        return self.rebinds >= CONFLICT_AFTER

    def holds(self, now: float) -> bool:
        """True while the back-off keeps the loop from re-binding."""
        return now < self.hold_until

    def after_rebind(self, now: float, interval_s: float) -> Fight:
        """The fight after one more re-bind at `now`: from the CONFLICT_AFTER-th
        on, hold off the next one twice as long as the last, up to BACKOFF_MAX."""
        n = self.rebinds + 1
        if n < CONFLICT_AFTER:
            return replace(self, rebinds=n)
        first, cap = BACKOFF_FIRST * interval_s, BACKOFF_MAX * interval_s
        backoff = first if self.backoff_s <= 0 else min(self.backoff_s * 2, cap)
        return Fight(n, now + backoff, backoff)


def held(
    f: Finding, target: str, fights: Mapping[str, Fight], now: float, out: list[Finding]
) -> bool:
    """True while `target`'s fight with an outside writer holds its repair off
    (`f`: the finding it repairs); a fight past CONFLICT_AFTER rounds adds its
    `conflict` finding to `out`, once a pass."""
    fight = fights.get(target)
    if fight is None or not fight.conflict:
        return False
    if not any(c.target == target for c in out):
        out.append(Finding("conflict", target, f.expected, f"{f.actual}, {WRITER_UNKNOWN}"))
    return fight.holds(now)


def fights_on(
    fights: Mapping[str, Fight], drift_tids: set[int], findings: tuple[Finding, ...]
) -> Mapping[str, Fight]:
    """The fights still on after a pass: a thread found where it belongs (or a
    cgroup as made) ends its fight, the writer stopped. The same mapping when none."""
    if not fights:
        return fights
    on = {f"tid {t}" for t in drift_tids}
    if any(f.kind == "cgroup" for f in findings):
        on.add("cgroup")
    return {t: f for t, f in fights.items() if t in on}
