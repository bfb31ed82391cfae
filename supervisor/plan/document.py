"""The vLLM-Ascend CPU binding document's two allocators, as it states them (pure, no I/O).

`placement.allocator = "topo_affinity"`: each device's pool is its CPU
affinity (local_cpulist, else its node's CPUs) within the allowed CPUs,
extended by the next NUMA node's allowed CPUs when it lies on one node;
hidden devices whose affinity meets the allowed CPUs are candidates too, so
devices sharing a pool split it the same way in every supervisor, and each
keeps its part. `"global_slice"`: the sorted allowed CPUs cut by logical id,
`base = len // total`, the first `extra = len % total` ids one more. Both in
CPUs, not cores, as the document does; roles then go by CPU too.
"""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.cpulist import format_cpulist
from supervisor.errors import PlanError
from supervisor.plan.roles import carve_engine, roles_fit
from supervisor.plan.view import DeviceKey, DeviceStrategy, Draft, HostView, device_key
from supervisor.topology.model import Device, Topology


def _affinity(topology: Topology, d: Device) -> frozenset[int] | None:
    if d.local_cpus is not None:
        return d.local_cpus
    if d.numa_node is None:
        return None
    node = next((n for n in topology.nodes if n.id == d.numa_node), None)
    return node.cpus if node is not None and node.cpus else None


def _extend(view: HostView, pool: list[int], allowed: frozenset[int]) -> list[int]:
    """A pool on one node, with the allowed CPUs of the next node (by id, wrapping)."""
    nodes = {view.cpu_node.get(c, -1) for c in pool}
    with_cpus = sorted(n for n in view.nodes_with_cpus if n >= 0)
    if len(nodes) != 1 or not with_cpus or next(iter(nodes)) not in with_cpus:
        return pool
    node = next(iter(nodes))
    nxt = with_cpus[(with_cpus.index(node) + 1) % len(with_cpus)]
    extra = {c for c in view.nodes[nxt].cpus if c in allowed}
    return sorted(set(pool) | extra)


def topo_affinity(
    topology: Topology, view: HostView, members: Sequence[Device], draft: Draft
) -> bool:
    """Fill draft.shares by affinity; False (nothing filled) when no visible device has one."""
    allowed = frozenset(c for core in view.cores for c in core)
    affinity = {device_key(d): _affinity(topology, d) for d in members}
    if not any(affinity[device_key(d)] for d in members if d.visible):
        return False
    pools: dict[DeviceKey, list[int]] = {}
    for d in members:
        mine = affinity[device_key(d)]
        base = sorted(mine & allowed) if mine else []
        if not base:
            if d.visible:
                raise PlanError(
                    f"topo_affinity: {d.label}'s CPU affinity "
                    f"{format_cpulist(mine or ()) or 'unknown'} has no allowed CPU "
                    f"(allowed: {format_cpulist(allowed)})"
                )
            continue  # a hidden device outside this cpuset is not a candidate
        pools[device_key(d)] = _extend(view, base, allowed)
    groups: dict[tuple[int, ...], list[Device]] = {}
    for d in members:
        if device_key(d) in pools:
            groups.setdefault(tuple(pools[device_key(d)]), []).append(d)
    _warn_overlapping_groups(groups, draft)
    for pool, group in groups.items():
        per = len(pool) // len(group)
        for i, d in enumerate(group):
            end = (i + 1) * per if i < len(group) - 1 else len(pool)
            draft.shares[device_key(d)] = [(c,) for c in pool[i * per : end]]
            names = ", ".join(g.label + ("" if g.visible else " (hidden)") for g in group)
            draft.where[device_key(d)] = (
                f"topo_affinity pool {format_cpulist(pool)}",
                f"affinity pool {format_cpulist(pool)} split among {names}",
            )
    return True


def _warn_overlapping_groups(groups: dict[tuple[int, ...], list[Device]], draft: Draft) -> None:
    """The document splits only identical pools: two groups whose (extended)
    pools differ but meet share those CPUs, in one process or across several
    (A3's ubcore nodes: NPU0/2 on node 0 extend to 0-159, NPU1/3 on node 1 to
    80-239). Kept as the document does it; said, with the way out."""
    pools = list(groups.items())
    for i, (a, ga) in enumerate(pools):
        for b, gb in pools[i + 1 :]:
            common = set(a) & set(b)
            if common:
                draft.warnings.append(
                    "topo_affinity: the pools of "
                    f"{', '.join(d.label for d in ga)} and {', '.join(d.label for d in gb)} "
                    f"share CPU {format_cpulist(common)} (extended pools that differ are not "
                    "split, as in the document); allocator global_slice never overlaps"
                )


def global_slice(view: HostView, members: Sequence[Device], draft: Draft) -> None:
    """Fill draft.shares with the document's slices of the allowed CPUs by logical id."""
    allowed = sorted(c for core in view.cores for c in core)
    total = len(members)
    base, extra = divmod(len(allowed), total)
    for position, d in enumerate(members):
        start = position * base + min(position, extra)
        take = base + (1 if position < extra else 0)
        draft.shares[device_key(d)] = [(c,) for c in allowed[start : start + take]]
        draft.where[device_key(d)] = (
            f"global_slice {position} of {total}",
            f"allowed CPUs: {len(allowed)} over {total} devices (base {base}, extra {extra})",
        )


def document_shares(
    topology: Topology, view: HostView, members: Sequence[Device], draft: Draft
) -> DeviceStrategy:
    """Fill draft.shares as `draft.settings.allocator` says; the strategy each rank reports."""
    if draft.settings.allocator == "topo_affinity":
        if topo_affinity(topology, view, members, draft):
            return "topo-affinity"
        draft.warnings.append(
            "topo_affinity: no visible device has a CPU affinity (local_cpulist or NUMA "
            "node); falling back to global_slice as the document does"
        )
    global_slice(view, members, draft)
    return "global-slice"


def plan_document(
    topology: Topology,
    view: HostView,
    devices: Sequence[Device],
    visible: Sequence[Device],
    draft: Draft,
) -> dict[DeviceKey, DeviceStrategy]:
    """Shares of every device of the visible kind by the document's allocator;
    the engine (where enabled) from the end of rank 0's own pool, so it never
    touches another device's pool either (no "end of the node" that every
    supervisor on the host would pick)."""
    kinds = sorted({d.kind for d in visible})
    if len(kinds) > 1:
        raise PlanError(
            f"allocator {draft.settings.allocator}: one device kind per supervisor, "
            f"but {', '.join(kinds)} are visible"
        )
    members = [d for d in devices if d.kind == kinds[0]]
    strategy = document_shares(topology, view, members, draft)
    if draft.settings.engine:
        key = device_key(visible[0])
        draft.shares[key] = carve_engine(
            draft,
            draft.shares[key],
            1,
            f"rank 0's {draft.where[key][0]}",
            lambda rest: roles_fit(draft.settings, rest),
        )
    return {k: strategy for k in draft.shares}
