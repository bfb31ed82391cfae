"""The placement planner: `plan(topology, settings) -> Placement` (pure, no I/O).

Re-run on every cpuset change, so it is deterministic (same input, same plan,
whatever order devices are listed in) and cheap (linear in CPUs and devices).
CPUs are handed out in whole physical cores; SMT siblings never part.
Its last step puts each rank's IRQs on the plan (supervisor.plan.irqs.with_irqs).
Over 500 lines because every step (device groups, pools, the engine's carve,
slots) works on one private draft (`_View`, `_Draft`); splitting it would
export that draft's internals to every piece.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from math import inf
from typing import Literal

from supervisor.cpulist import format_cpulist
from supervisor.errors import PlanError
from supervisor.plan.irqs import with_irqs
from supervisor.plan.placement import (
    DeviceRef,
    Placement,
    PlanSettings,
    RankPlacement,
    Shortage,
    Slot,
    Strategy,
)
from supervisor.topology.accelerators import CPU, VISIBILITY_VARIABLES, or_list
from supervisor.topology.model import Device, Node, Topology, device_order, rank_order

Core = tuple[int, ...]
"""The allowed online SMT siblings of one physical core, sorted (one CPU without SMT)."""

DeviceStrategy = Literal["numa-affine", "global-slice"]
DeviceKey = tuple[str, int]

# Where a rank's roles sit inside its pool. `irq` takes the pool's first cores:
# a rank's pool starts at its share's first core, and the node's first CPU is
# where unmovable housekeeping (the boot CPU's timers, legacy and managed IRQs)
# already runs (Documentation/admin-guide/kernel-per-CPU-kthreads.rst), so the
# interrupt role is the one that loses least by sitting there. Every other
# sized role (comm, ...) takes cores from the pool's end, in the order the
# settings list them, like vllm-ascend's pool[-2]/pool[-1] split; `main` keeps
# the contiguous middle.
FRONT_ROLES = ("irq",)


@dataclass(frozen=True, slots=True)
class _View:
    """The part of the topology the planner uses, indexed once."""

    cores: tuple[Core, ...]  # allowed cores, by first CPU
    core_node: Mapping[Core, int]  # -1 when no NUMA node lists the core
    node_cores: Mapping[int, tuple[Core, ...]]  # nodes with allowed cores only
    nodes: Mapping[int, Node]
    cpu_node: Mapping[int, int]
    nodes_with_cpus: frozenset[int]  # nodes with online CPUs at all (not HBM/CXL)
    allowed_mems: frozenset[int]  # empty: unrestricted


@dataclass(slots=True)
class _Draft:
    """Mutable scratch of one plan() call; never escapes it."""

    settings: PlanSettings
    mode: Shortage
    shares: dict[DeviceKey, list[Core]] = field(default_factory=dict)
    # (place, context): ("node 1", "allowed CPUs on node 1: 8 for 2 devices")
    where: dict[DeviceKey, tuple[str, str]] = field(default_factory=dict)
    engine: list[Core] | None = None
    engine_roles: dict[str, list[Core]] | None = None
    engine_node: int | None = None  # set when the engine sits on a device-free node
    warnings: list[str] = field(default_factory=list)


def plan(topology: Topology, settings: PlanSettings) -> Placement:
    """Plan CPUs, roles and memory nodes for every visible device's rank and the engine.

    Raises PlanError (exit 3) naming the numbers when no plan satisfies the
    settings (`on_shortage = "error"`), when no CPU is allowed, or when no
    accelerator is visible.
    """
    view = _view(topology)
    if not view.cores:
        raise PlanError(
            "no allowed CPUs: the supervisor's affinity and cpuset leave "
            f"{format_cpulist(topology.allowed.cpus) or 'nothing'} of online "
            f"{format_cpulist(topology.online) or 'nothing'}"
        )
    # Two orders: shares and slices go by the host's device order, so every
    # supervisor on the host computes the same ones; ranks go by the
    # visibility list (DESIGN 3.3), the ordinal the engine's workers use.
    devices = sorted(topology.devices, key=device_order)
    visible = sorted((d for d in devices if d.visible), key=rank_order)
    if not visible:
        raise PlanError(_no_visible_message(devices))
    rank_devices = _group_ranks(visible, settings.devices_per_rank)
    draft = _Draft(settings, _shortage_mode(settings, visible))
    strategies = _device_strategies(view, devices, settings, draft.warnings)

    # Only kinds this supervisor drives take part; within them, hidden devices
    # keep their share (reserve_hidden) so two supervisors on one host that
    # see different devices compute the same shares and never overlap.
    kinds = {d.kind for d in visible}
    numa_members = [
        d
        for d in devices
        if d.kind in kinds
        and strategies.get(_key(d)) == "numa-affine"
        and (d.visible or settings.reserve_hidden)
    ]
    # Global slicing counts every device of the kind, visible or not: the slice
    # of device i is the same in every supervisor sharing this cpuset, whatever
    # each one sees (vllm-ascend's global_slice property).
    global_members = [
        d for d in devices if d.kind in kinds and strategies.get(_key(d)) == "global-slice"
    ]
    cpu_node = {_key(d): _nearest_cpu_node(view, d.numa_node) for d in numa_members}
    block = _global_block(view, numa_members, global_members, cpu_node)
    taken = set(block)
    if global_members and not block and draft.mode == "share":
        # Not even one core left for the global-slice devices: they share all.
        block = list(view.cores)
        draft.warnings.append(
            "global-slice devices share every allowed core: the numa-affine nodes leave none free"
        )
    rank0 = rank_devices[0][0]
    engine_on_rank0_node = settings.engine and strategies[_key(rank0)] == "numa-affine"
    if engine_on_rank0_node and not global_members:
        draft.engine_node = _engine_node(view, settings, devices, cpu_node[_key(rank0)])
        if draft.engine_node is not None:
            engine_on_rank0_node = False
            _place_engine_apart(view, draft, cpu_node[_key(rank0)])

    by_node: dict[int, list[Device]] = {}
    for d in numa_members:
        by_node.setdefault(cpu_node[_key(d)], []).append(d)
    for node_id in sorted(by_node):
        cores = [c for c in view.node_cores[node_id] if c not in taken]
        engine_here = engine_on_rank0_node and cpu_node[_key(rank0)] == node_id
        _plan_group(draft, f"node {node_id}", cores, by_node[node_id], engine_here)
    if global_members:
        _plan_group(draft, "global slice", block, global_members, engine_here=False)
        if settings.engine and strategies[_key(rank0)] == "global-slice":
            # The engine comes out of the driver rank's own slice (DeepInfer
            # carves the grammar-compiler pool from the driver GPU's quota),
            # so it never touches another device's global slice either.
            share = draft.shares[_key(rank0)]
            kept = _carve_engine(
                draft,
                share,
                1,
                f"rank 0's {draft.where[_key(rank0)][0]}",
                lambda rest: _rank_roles(settings, rest) is not None,
            )
            draft.shares[_key(rank0)] = kept

    ranks = tuple(
        _rank_placement(view, draft, rank, devs, strategies)
        for rank, devs in enumerate(rank_devices)
    )
    engine = None
    if settings.engine and draft.engine is not None and draft.engine_roles is not None:
        engine = Slot(
            _cpus(draft.engine),
            _engine_mems(view, draft.engine_node, ranks[0].slot.mems),
            {role: _cpus(cores) for role, cores in draft.engine_roles.items()},
        )
    shared = _shared_warning(ranks, engine, draft.warnings)
    used = {r.strategy for r in ranks}
    strategy: Strategy = used.pop() if len(used) == 1 else "mixed"
    placement = Placement(
        strategy,
        engine,
        ranks,
        tuple(draft.warnings),
        shared,
        engine_node=draft.engine_node if engine is not None else None,
    )
    return with_irqs(topology, placement, settings)


# -- the host view -----------------------------------------------------------


def _view(topology: Topology) -> _View:
    allowed = topology.allowed.cpus & topology.online
    by_id = {c.id: c for c in topology.cpus}
    # Union-find over sibling lists: a core is whatever its siblings connect,
    # so one inconsistent thread_siblings_list cannot make two cores overlap.
    parent = {c: c for c in allowed}

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for cpu_id in sorted(allowed):
        for sibling in by_id[cpu_id].siblings:
            if sibling in allowed:
                a, b = root(cpu_id), root(sibling)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for cpu_id in sorted(allowed):
        groups.setdefault(root(cpu_id), []).append(cpu_id)
    cores = tuple(sorted(tuple(g) for g in groups.values()))
    cpu_node = {c.id: c.node for c in topology.cpus}
    core_node = {core: cpu_node[core[0]] for core in cores}
    node_cores: dict[int, list[Core]] = {}
    for core in cores:
        if core_node[core] >= 0:
            node_cores.setdefault(core_node[core], []).append(core)
    nodes = {n.id: n for n in topology.nodes}
    with_cpus = frozenset(n.id for n in topology.nodes if n.cpus) | {
        n for n in cpu_node.values() if n >= 0
    }
    return _View(
        cores=cores,
        core_node=core_node,
        node_cores={n: tuple(cs) for n, cs in node_cores.items()},
        nodes=nodes,
        cpu_node=cpu_node,
        nodes_with_cpus=with_cpus,
        allowed_mems=topology.allowed.mems,
    )


def _key(device: Device) -> DeviceKey:
    return (device.kind, device.index)


def _distance(view: _View, a: int, b: int) -> float:
    if a == b:
        return 0
    node = view.nodes.get(a)
    dist = None if node is None else node.distance_to(b)
    return inf if dist is None else dist


def _nearest(view: _View, start: int, candidates: Iterable[int]) -> int | None:
    """The candidate closest to `start` by SLIT distance; ties (and unknown
    distances) go to the lowest node id, so the choice is deterministic."""
    ordered = sorted(candidates, key=lambda n: (_distance(view, start, n), n))
    return ordered[0] if ordered else None


def _nearest_cpu_node(view: _View, node_id: int | None) -> int:
    # Callers only pass devices with a known node, on a view with node cores.
    assert node_id is not None
    if node_id in view.node_cores:
        return node_id
    nearest = _nearest(view, node_id, view.node_cores)
    assert nearest is not None
    return nearest


# -- ranks and strategies ----------------------------------------------------


def _no_visible_message(devices: Sequence[Device]) -> str:
    if not devices:
        return "no visible accelerator: none found on this host"
    found = ", ".join(d.label for d in devices)
    return (
        f"no visible accelerator: found {found}, all hidden by the visibility variable "
        f"({or_list(VISIBILITY_VARIABLES)})"
    )


def _group_ranks(visible: Sequence[Device], per_rank: int) -> list[list[Device]]:
    if per_rank < 1 or len(visible) % per_rank:
        labels = ", ".join(d.label for d in visible)
        raise PlanError(
            f"devices_per_rank = {per_rank} does not divide the {len(visible)} visible "
            f"devices ({labels})"
        )
    return [list(visible[i : i + per_rank]) for i in range(0, len(visible), per_rank)]


def _shortage_mode(settings: PlanSettings, visible: Sequence[Device]) -> Shortage:
    if settings.on_shortage is not None:
        return settings.on_shortage
    # A host without accelerators is the demo or a CI box: a shared plan with
    # warnings beats refusing to start.
    return "share" if all(d.kind == CPU.name for d in visible) else "error"


def _device_strategies(
    view: _View, devices: Sequence[Device], settings: PlanSettings, warnings: list[str]
) -> dict[DeviceKey, DeviceStrategy]:
    """numa-affine or global-slice for each device that takes part in planning."""
    out: dict[DeviceKey, DeviceStrategy] = {}
    unknown: list[str] = []
    no_nodes = not view.node_cores  # no allowed CPU belongs to any NUMA node
    for d in devices:
        if settings.strategy == "global-slice":
            out[_key(d)] = "global-slice"
        elif d.numa_node is not None and not no_nodes:
            out[_key(d)] = "numa-affine"
        elif settings.strategy == "numa-affine":
            if d.visible:
                why = (
                    "no allowed CPU belongs to a NUMA node"
                    if no_nodes
                    else f"{d.label} ({d.bdf or 'no PCI address'}) has no known NUMA node"
                )
                raise PlanError(f"strategy numa-affine: {why}; use strategy auto or global-slice")
            # a hidden device of unknown locality reserves nothing here
        else:
            out[_key(d)] = "global-slice"
            if d.visible:
                unknown.append(f"{d.label} ({d.bdf or 'no PCI address'})")
    if unknown:
        warnings.append(f"no known NUMA node for {', '.join(unknown)}: planned by global-slice")
    return out


# -- pools -------------------------------------------------------------------


def _global_block(
    view: _View,
    numa_members: Sequence[Device],
    global_members: Sequence[Device],
    cpu_node: Mapping[DeviceKey, int],
) -> list[Core]:
    """The cores global-slice devices are sliced from, disjoint from numa-affine pools.

    Alone, global-slice takes every allowed core. Mixed with numa-affine
    devices it takes the cores of nodes no numa-affine device uses (and CPUs
    no node lists); when those are fewer than the global-slice devices, each
    numa-affine node also gives up its fair share, n_global / n_all of its
    cores, from its end, so known devices keep their own node.
    """
    if not global_members:
        return []
    if not numa_members:
        return list(view.cores)
    used = set(cpu_node.values())
    block = [c for c in view.cores if view.core_node[c] not in used]
    if len(block) < len(global_members):
        total = len(numa_members) + len(global_members)
        for node_id in sorted(used):
            cores = view.node_cores[node_id]
            give = len(cores) * len(global_members) // total
            block.extend(cores[len(cores) - give :])
    return sorted(block)


def _split_even(cores: Sequence[Core], count: int) -> list[list[Core]]:
    """`count` contiguous shares of whole cores; earlier shares get the extra core."""
    base, extra = divmod(len(cores), count)
    shares: list[list[Core]] = []
    start = 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        shares.append(list(cores[start : start + size]))
        start += size
    return shares


def _plan_group(
    draft: _Draft, where: str, cores: list[Core], members: Sequence[Device], engine_here: bool
) -> None:
    """Split one node (or the global block) among its devices, engine first."""
    before = sum(len(c) for c in cores)
    if engine_here:

        def fits(rest: list[Core]) -> bool:
            shares = _split_even(rest, len(members))
            return all(
                _rank_roles(draft.settings, share) is not None
                for d, share in zip(members, shares, strict=True)
                if d.visible
            )

        cores = _carve_engine(draft, cores, len(members), f"{where} (rank 0's node)", fits)
    shares = _split_even(cores, len(members))
    if cores and len(cores) < len(members) and draft.mode == "share":
        # More devices than cores: device i gets core i mod n (round-robin).
        shares = [[cores[i % len(cores)]] for i in range(len(members))]
        draft.warnings.append(
            f"{where}: {len(cores)} allowed cores for {len(members)} devices "
            f"({', '.join(_member_label(d) for d in members)}); cores assigned round-robin"
        )
    total = sum(len(c) for c in cores)
    counts = f"{before}, {before - total} to the engine, {total}" if before != total else f"{total}"
    for i, d in enumerate(members):
        draft.shares[_key(d)] = shares[i]
        if where == "global slice":
            draft.where[_key(d)] = (
                f"global slice {i} of {len(members)}",
                f"allowed CPUs: {total} over {len(members)} devices",
            )
        else:
            draft.where[_key(d)] = (
                where,
                f"allowed CPUs on {where}: {counts} for {len(members)} devices",
            )


def _member_label(d: Device) -> str:
    return d.label if d.visible else f"{d.label} (hidden)"


def _engine_sizes(settings: PlanSettings) -> list[tuple[str, int]]:
    return [("main", settings.engine_main_cpus), *settings.engine_roles.items()]


def _rank_roles(settings: PlanSettings, cores: Sequence[Core]) -> dict[str, list[Core]] | None:
    """A rank's roles in `cores`, or None when they do not fit."""
    front = [(r, s) for r, s in settings.rank_roles.items() if r in FRONT_ROLES]
    back = [(r, s) for r, s in settings.rank_roles.items() if r not in FRONT_ROLES]
    return _split_roles(cores, front, back, settings.min_main_cpus)


def _carve_engine(
    draft: _Draft,
    cores: list[Core],
    leave: int,
    where: str,
    fits: Callable[[list[Core]], bool],
) -> list[Core]:
    """Take the engine's slot from the end of `cores`; return what is left.

    The end, because rank pools (and their irq role) start at a node's first
    cores, where the boot CPU's housekeeping runs; the engine's scheduler loop
    is the most latency-bound thread of the server and sits farthest from it.

    The engine gives way to the ranks, in every shortage mode: when its full
    slot would leave a rank short (`fits` says no, or fewer than `leave`
    cores remain), its roles merge into main (engine_main_cpus), then it
    shrinks to one core, with a warning. Like DeepInfer, which defers the
    grammar-compiler shortage so that a deployment without structured output
    still starts. Only then does the mode decide: "error" and "merge" fail
    here if not even one core is left over; "share" shares the last core.
    """
    settings = draft.settings
    names = " + ".join(f"{r} {s}" for r, s in _engine_sizes(settings) if s > 0)
    have = sum(len(c) for c in cores)
    full = _take_from_end(cores, _engine_sizes(settings))
    candidates = [
        n
        for n in (full, _take_from_end(cores, [("main", settings.engine_main_cpus)]), 1)
        if n is not None and n <= len(cores) - leave
    ]
    count = next((n for n in candidates if fits(cores[: len(cores) - n])), None)
    if count is None and candidates:
        # No engine size lets every rank keep its roles: the ranks' shortage
        # is reported (error) or merged (merge, share) when their slots are made.
        count = candidates[0] if draft.mode != "error" else candidates[-1]
    if count is None:
        if draft.mode == "share" and cores:
            # The engine overlays the whole node and keeps its roles apart
            # from each other where the node has a core per role, so even a
            # 2-CPU demo box shows a compiler pool on CPUs of its own role.
            one_each = [(r, 1) for r, s in settings.engine_roles.items() if s > 0]
            roles = _split_roles(
                cores, [], list(settings.engine_roles.items()), settings.engine_main_cpus
            ) or _split_roles(cores, [], one_each, 1)
            draft.engine = list(cores)
            draft.engine_roles = roles if roles is not None else {"main": list(cores)}
            draft.warnings.append(
                f"engine: {where} has {len(cores)} allowed cores for the engine and "
                f"{leave} devices; the engine shares the node's cores with the ranks"
            )
            return cores
        raise PlanError(
            f"engine needs a core of its own on {where} besides one per device, but "
            f"{where} has {len(cores)} allowed cores ({have} CPUs) for the engine and "
            f"{leave} devices"
            + ('; on_shortage = "share" would share CPUs' if draft.mode != "share" else "")
        )
    engine = cores[len(cores) - count :]
    roles = None
    if count == full:
        roles = _split_roles(
            engine, [], list(settings.engine_roles.items()), settings.engine_main_cpus
        )
    if roles is None:
        draft.warnings.append(
            f"engine: {where} has {have} allowed CPUs, too few for the engine's {names} "
            f"besides the ranks' roles; engine roles merged into main "
            f"({_count(engine)})"
        )
    draft.engine = engine
    draft.engine_roles = roles if roles is not None else {"main": engine}
    return cores[: len(cores) - count]


def _engine_node(
    view: _View, settings: PlanSettings, devices: Sequence[Device], rank0_node: int
) -> int | None:
    """The device-free node nearest rank 0's node that holds the engine's full
    slot, or None (then the engine comes out of rank 0's node, as before).

    On hosts with more nodes than device nodes (Xeon 6 SNC3 with GPUs on 4 of
    6 nodes) the engine's scheduler and compiler pool then take nothing from
    rank 0's cores. A node is a device's home when any device of the host,
    visible or hidden, plans its CPUs there: another supervisor's ranks may
    live on it. Nearest by SLIT distance from rank 0's node; ties go to the
    lowest id.
    """
    homes = {_nearest_cpu_node(view, d.numa_node) for d in devices if d.numa_node is not None}
    sizes = _engine_sizes(settings)
    free = [
        n
        for n, cores in view.node_cores.items()
        if n not in homes and _take_from_end(cores, sizes) is not None
    ]
    return _nearest(view, rank0_node, free)


def _place_engine_apart(view: _View, draft: _Draft, rank0_node: int) -> None:
    """The engine's slot from the end of its device-free node, roles as configured."""
    node = draft.engine_node
    assert node is not None
    cores = list(view.node_cores[node])
    distance = _distance(view, rank0_node, node)
    _carve_engine(draft, cores, 0, f"node {node}", lambda rest: True)
    draft.warnings.append(
        f"engine: on node {node}, which has no device (nearest to rank 0's node "
        f"{rank0_node}, distance {distance:g}); the ranks keep all of their nodes' CPUs"
    )


def _engine_mems(
    view: _View, engine_node: int | None, rank0_mems: tuple[int, ...]
) -> tuple[int, ...]:
    """The engine's memory: its own node when it sits apart (where allowed),
    else rank 0's nodes (DESIGN 3.3)."""
    if engine_node is not None and (not view.allowed_mems or engine_node in view.allowed_mems):
        return (engine_node,)
    return rank0_mems


def _take_from_end(cores: Sequence[Core], sizes: Sequence[tuple[str, int]]) -> int | None:
    """How many cores, counted from the end, hold `sizes` CPUs role by role; None if short."""
    j = len(cores)
    for _, size in reversed(sizes):
        got = 0
        while got < size:
            if j == 0:
                return None
            j -= 1
            got += len(cores[j])
    return len(cores) - j


def _split_roles(
    cores: Sequence[Core],
    front: Sequence[tuple[str, int]],
    back: Sequence[tuple[str, int]],
    main_min: int,
) -> dict[str, list[Core]] | None:
    """Roles in whole cores: `front` from the start, `back` from the end (in
    order), `main` the middle with at least `main_min` CPUs; None if short."""
    roles: dict[str, list[Core]] = {}
    i = 0
    for role, size in front:
        start, got = i, 0
        while got < size and i < len(cores):
            got += len(cores[i])
            i += 1
        if got < size:
            return None
        if size > 0:
            roles[role] = list(cores[start:i])
    tail: dict[str, list[Core]] = {}
    j = len(cores)
    for role, size in reversed(back):
        end, got = j, 0
        while got < size and j > i:
            j -= 1
            got += len(cores[j])
        if got < size:
            return None
        if size > 0:
            tail[role] = list(cores[j:end])
    main = list(cores[i:j])
    if sum(len(c) for c in main) < max(main_min, 1):
        return None
    roles["main"] = main
    for role, _ in back:
        if role in tail:
            roles[role] = tail[role]
    return roles


# -- slots -------------------------------------------------------------------


def _cpus(cores: Iterable[Core]) -> tuple[int, ...]:
    return tuple(sorted(cpu for core in cores for cpu in core))


def _rank_placement(
    view: _View,
    draft: _Draft,
    rank: int,
    devices: Sequence[Device],
    strategies: Mapping[DeviceKey, DeviceStrategy],
) -> RankPlacement:
    settings = draft.settings
    cores = sorted({c for d in devices for c in draft.shares[_key(d)]})
    front = [(r, s) for r, s in settings.rank_roles.items() if r in FRONT_ROLES]
    back = [(r, s) for r, s in settings.rank_roles.items() if r not in FRONT_ROLES]
    roles = _rank_roles(settings, cores)
    label = "+".join(d.label for d in devices)
    if roles is None:
        cpus = sum(len(c) for c in cores)
        sizes = [f"{r} {s}" for r, s in [*front, *back] if s > 0]
        wanted = " + ".join([*sizes, f"main >= {settings.min_main_cpus}"])
        # Each role takes whole cores: count cores at the pool's widest SMT.
        per_core = max((len(c) for c in cores), default=1)
        need = sum(-(-s // per_core) for _, s in [*front, *back] if s > 0)
        need += -(-max(settings.min_main_cpus, 1) // per_core)
        unit = "cores" if per_core > 1 else "CPUs"
        got = f"{cpus} CPUs ({len(cores)} cores)" if per_core > 1 else f"{cpus} CPUs"
        place = " + ".join(draft.where[_key(d)][0] for d in devices)
        context = "; ".join(dict.fromkeys(draft.where[_key(d)][1] for d in devices))
        if draft.mode == "error" or not cores:
            hint = "" if draft.mode == "error" else '; on_shortage = "share" would share CPUs'
            raise PlanError(
                f"rank {rank} ({label} on {place}) gets {got} but needs {need} {unit}: "
                f"{wanted}{' in whole cores' if per_core > 1 else ''}; {context}{hint}"
            )
        draft.warnings.append(
            f"rank {rank} ({label}): {cpus} CPU{'s' if cpus != 1 else ''} cannot hold "
            f"{wanted} in whole cores; roles merged into main"
        )
        roles = {"main": cores}
    mems: set[int] = set()
    for d in devices:
        mems.update(_device_mems(view, draft, d, strategies[_key(d)]))
    kinds = {strategies[_key(d)] for d in devices}
    strategy: Strategy = kinds.pop() if len(kinds) == 1 else "mixed"
    refs = tuple(DeviceRef(d.kind, d.index, d.bdf, d.numa_node, d.uuid) for d in devices)
    return RankPlacement(
        rank=rank,
        device=refs[0],
        slot=Slot(_cpus(cores), tuple(sorted(mems)), {r: _cpus(c) for r, c in roles.items()}),
        local_rank=rank,
        devices=refs if len(refs) > 1 else (),
        strategy=strategy,
    )


def _device_mems(view: _View, draft: _Draft, d: Device, strategy: DeviceStrategy) -> list[int]:
    """DESIGN 3.3: the device's node, or for a CPU-less (HBM) device node the
    nearest node with CPUs; global-slice: the nodes of the slice's CPUs. Then
    kept inside the allowed mems (nearest allowed node with CPUs otherwise)."""
    if strategy == "numa-affine" and d.numa_node is not None:
        if d.numa_node in view.nodes_with_cpus:
            wanted = [d.numa_node]
        else:
            nearest = _nearest(view, d.numa_node, view.nodes_with_cpus)
            wanted = [] if nearest is None else [nearest]
    else:
        wanted = sorted({view.core_node[c] for c in draft.shares[_key(d)]} - {-1})
    allowed = view.allowed_mems
    ok = [n for n in wanted if n in allowed] if allowed else wanted
    if ok:
        return ok
    candidates = [n for n in (allowed or view.nodes) if n in view.nodes_with_cpus]
    start = wanted[0] if wanted else (d.numa_node if d.numa_node is not None else 0)
    nearest = _nearest(view, start, candidates)
    if nearest is None:
        raise PlanError(
            f"{d.label}: no allowed memory node has CPUs (allowed mems: "
            f"{format_cpulist(allowed) or 'none'})"
        )
    draft.warnings.append(
        f"{d.label}: memory node {format_cpulist(wanted) or 'unknown'} is not allowed "
        f"(allowed mems: {format_cpulist(allowed)}); binding memory to node {nearest}"
    )
    return [nearest]


def _shared_warning(
    ranks: Sequence[RankPlacement], engine: Slot | None, warnings: list[str]
) -> bool:
    """Say exactly which CPUs serve more than one process; True if any do."""
    users: dict[int, list[str]] = {}
    for r in ranks:
        for cpu in r.slot.cpus:
            users.setdefault(cpu, []).append(f"rank {r.rank}")
    if engine is not None:
        for cpu in engine.cpus:
            users.setdefault(cpu, []).append("engine")
    by_users: dict[tuple[str, ...], list[int]] = {}
    for cpu, who in users.items():
        if len(who) > 1:
            by_users.setdefault(tuple(who), []).append(cpu)
    if not by_users:
        return False
    parts = [
        f"CPU {format_cpulist(cpus)} by {' and '.join(who)}"
        for who, cpus in sorted(by_users.items(), key=lambda kv: min(kv[1]))
    ]
    warnings.append("CPUs shared (fewer allowed cores than processes): " + "; ".join(parts))
    return True


def _count(cores: Iterable[Core]) -> str:
    n = sum(len(c) for c in cores)
    return f"{n} CPU" if n == 1 else f"{n} CPUs"
