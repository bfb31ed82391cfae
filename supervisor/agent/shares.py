"""Each container's share of the CPUs when containers' cpusets overlap (pure).

A node agent places every engine container on its node (issue 31); two
containers whose cgroups allow the same CPUs must not both bind threads onto
them. A CPU that one container alone may use stays that container's. The CPUs
that the same set of containers share (a region) are split among them in
contiguous runs, as evenly as the count allows, the first run to the first
container by cgroup path (so the split is the same on every pass). A container
left with no CPU at all is refused with the reason, and the split is made again
without it (its CPUs go to the others).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from supervisor.cpulist import format_cpulist


@dataclass(frozen=True, slots=True)
class Share:
    """One container's CPUs to plan within, or why it gets none."""

    cpus: frozenset[int]  # empty when refused
    reason: str | None = None  # "cannot place: ..." when refused


def _split(sets: Mapping[str, frozenset[int]]) -> dict[str, frozenset[int]]:
    regions: dict[frozenset[int], list[int]] = {}  # claimants (as indices) -> CPUs
    names = sorted(sets)
    for cpu in sorted(set().union(*sets.values()) if sets else set()):
        claimants = frozenset(i for i, name in enumerate(names) if cpu in sets[name])
        regions.setdefault(claimants, []).append(cpu)
    out: dict[str, set[int]] = {name: set() for name in names}
    for claimants, cpus in regions.items():
        order = sorted(claimants)
        n, k = len(cpus), len(order)
        for j, i in enumerate(order):  # rounded up: the first by path get the odd CPUs
            out[names[i]].update(cpus[-(-j * n // k) : -(-(j + 1) * n // k)])
    return {name: frozenset(cpus) for name, cpus in out.items()}


def compute_shares(sets: Mapping[str, frozenset[int]]) -> dict[str, Share]:
    """cgroup path -> its Share, for containers whose cgroups allow `sets`' CPUs."""
    left = {name: cpus for name, cpus in sets.items() if cpus}
    refused = {
        name: Share(frozenset(), "cannot place: its cgroup allows no CPU")
        for name, cpus in sets.items()
        if not cpus
    }
    while True:
        split = _split(left)
        empty = sorted(name for name, cpus in split.items() if not cpus)
        if not empty:
            break
        # The last by path is refused first: the others keep the split they had.
        name = empty[-1]
        others = sorted(o for o in left if o != name and left[o] & left[name])
        refused[name] = Share(
            frozenset(),
            f"cannot place: its CPUs {format_cpulist(left[name])} are all shared with "
            f"{', '.join(others)}, and a share of them is less than one CPU",
        )
        del left[name]
    return {**refused, **{name: Share(cpus) for name, cpus in split.items()}}


def overlapping(sets: Mapping[str, frozenset[int]]) -> list[list[str]]:
    """The groups of containers linked by shared CPUs, each sorted, in path order (pure)."""
    groups: list[tuple[set[str], set[int]]] = []
    for name in sorted(sets):
        cpus = set(sets[name])
        merged = [g for g in groups if g[1] & cpus]
        names = {name}
        for g in merged:
            groups.remove(g)
            names |= g[0]
            cpus |= g[1]
        groups.append((names, cpus))
    return sorted(sorted(g[0]) for g in groups)
