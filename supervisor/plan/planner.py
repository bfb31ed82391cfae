"""The placement planner: `plan(topology, settings) -> Placement` (pure, no I/O).

Re-run on every cpuset change, so it is deterministic (same input, same plan,
whatever order devices are listed in) and cheap (linear in CPUs and devices).
CPUs are handed out in whole physical cores; SMT siblings never part.
Here: device strategies, pools and slots; the host view and draft in
supervisor.plan.view, roles and the engine's carve in supervisor.plan.roles.
Its last step puts each rank's IRQs on the plan (supervisor.plan.irqs.with_irqs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from supervisor.cpulist import format_cpulist
from supervisor.errors import PlanError
from supervisor.plan.document import plan_document
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
from supervisor.plan.roles import (
    FRONT_ROLES,
    carve_engine,
    engine_mems,
    find_engine_node,
    place_engine_apart,
    place_engine_share,
    rank_roles,
    roles_fit,
    single_cpus,
    split_by_l3,
    split_even,
)
from supervisor.plan.view import (
    Core,
    DeviceKey,
    DeviceStrategy,
    Draft,
    HostView,
    cpus_of,
    device_key,
    host_view,
    nearest_cpu_node,
    nearest_node,
)
from supervisor.topology.accelerators import CPU, VISIBILITY_VARIABLES, or_list
from supervisor.topology.model import Device, Topology, device_order, rank_order


def plan(topology: Topology, settings: PlanSettings) -> Placement:
    """Plan CPUs, roles and memory nodes for every visible device's rank and the engine.

    Raises PlanError (exit 3) naming the numbers when no plan satisfies the
    settings (`on_shortage = "error"`), when no CPU is allowed, or when no
    accelerator is visible. Where only the hidden devices' shares stand in
    the way, they give way (a plan for this supervisor beats none), and the
    plan says that another supervisor seeing them would overlap.
    """
    try:
        return _plan(topology, settings)
    except PlanError as first:
        view = host_view(topology)
        kinds = {d.kind for d in topology.devices if d.visible}
        hidden = [
            d.label
            for d in sorted(topology.devices, key=device_order)
            if not d.visible and d.kind in kinds and _home_allowed(view, d)
        ]
        if not (settings.reserve_hidden and hidden and settings.allocator == "supervisor"):
            raise
        why = str(first).split(";")[0]
        try:
            placement = _plan(topology, replace(settings, reserve_hidden=False))
        except PlanError:
            raise first from None
    warning = (
        f"hidden devices' shares dropped ({', '.join(hidden)}): with them, {why}; "
        "a supervisor on this cpuset that drives them would overlap with this one"
    )
    return replace(placement, warnings=(warning, *placement.warnings))


def _plan(topology: Topology, settings: PlanSettings) -> Placement:
    view = host_view(topology)
    if not view.cores:
        raise PlanError(
            "no allowed CPUs: the supervisor's affinity and cpuset leave "
            f"{format_cpulist(topology.allowed.cpus) or 'nothing'} of online "
            f"{format_cpulist(topology.online) or 'nothing'}"
        )
    # Two orders: shares and slices go by the host's device order, so every
    # supervisor on the host computes the same ones; ranks go by the
    # visibility list (docs/contracts.md §3), the ordinal the engine's workers use.
    devices = sorted(topology.devices, key=device_order)
    visible = sorted((d for d in devices if d.visible), key=rank_order)
    if not visible:
        raise PlanError(_no_visible_message(devices))
    rank_devices = _group_ranks(visible, settings.devices_per_rank)
    draft = Draft(settings, _shortage_mode(settings, visible))
    if settings.allocator != "supervisor":
        strategies = plan_document(topology, view, devices, visible, draft)
    else:
        strategies = _plan_pools(view, devices, visible, rank_devices[0][0], draft)

    ranks = tuple(
        _rank_placement(view, draft, rank, devs, strategies)
        for rank, devs in enumerate(rank_devices)
    )
    engine = None
    if settings.engine and draft.engine is not None and draft.engine_roles is not None:
        engine = Slot(
            cpus_of(draft.engine),
            engine_mems(view, draft.engine_node, ranks[0].slot.mems),
            {role: cpus_of(cores) for role, cores in draft.engine_roles.items()},
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


def _plan_pools(
    view: HostView,
    devices: Sequence[Device],
    visible: Sequence[Device],
    rank0: Device,
    draft: Draft,
) -> dict[DeviceKey, DeviceStrategy]:
    """The planner's own pools: node shares and global slices in whole cores, the engine's slot."""
    settings = draft.settings
    strategies = _device_strategies(view, devices, settings, draft.warnings)
    # Only kinds this supervisor drives take part; within them, hidden devices
    # keep their share (reserve_hidden) so two supervisors on one host that
    # see different devices compute the same shares and never overlap; but
    # only on their own node: where the cpuset leaves that node no CPU, the
    # device's own supervisor cannot be there, and a share folded onto
    # another node would take CPUs from nobody's benefit.
    kinds = {d.kind for d in visible}
    numa_members = [
        d
        for d in devices
        if d.kind in kinds
        and strategies.get(device_key(d)) == "numa-affine"
        and (d.visible or (settings.reserve_hidden and _home_allowed(view, d)))
    ]
    # Global slicing counts every device of the kind, visible or not: the slice
    # of device i is the same in every supervisor sharing this cpuset, whatever
    # each one sees (vllm-ascend's global_slice property).
    global_members = [
        d for d in devices if d.kind in kinds and strategies.get(device_key(d)) == "global-slice"
    ]
    cpu_node = {device_key(d): nearest_cpu_node(view, d.numa_node) for d in numa_members}
    for d in numa_members:
        if d.visible and not _home_allowed(view, d):
            draft.warnings.append(
                f"{d.label}: its node {d.numa_node} has no allowed CPU; planned on node "
                f"{cpu_node[device_key(d)]}, where supervisors that do not drive it keep "
                "no share for it (they may overlap with this one)"
            )
    block = _global_block(view, numa_members, global_members, cpu_node)
    taken = set(block)
    if global_members and not block and draft.mode == "share":
        # Not even one core left for the global-slice devices: they share all.
        block = list(view.cores)
        draft.warnings.append(
            "global-slice devices share every allowed core: the numa-affine nodes leave none free"
        )
    # With devices of this kind hidden, other supervisors may share the host:
    # "the end of the node" or a device-free node would be the same CPUs in
    # each of them, so the engine comes out of rank 0's own share instead.
    others = settings.reserve_hidden and any(not d.visible for d in devices if d.kind in kinds)
    rank0_numa = strategies[device_key(rank0)] == "numa-affine"
    engine_on_rank0_node = settings.engine and rank0_numa and not others
    if settings.engine and rank0_numa and not global_members:
        rank0_node = cpu_node[device_key(rank0)]
        draft.engine_node = find_engine_node(view, settings, devices, rank0_node)
        if draft.engine_node is not None and not others:
            engine_on_rank0_node = False
            place_engine_apart(view, draft, rank0_node)
        elif draft.engine_node is not None:
            place_engine_share(view, draft, rank0_node, numa_members)

    by_node: dict[int, list[Device]] = {}
    for d in numa_members:
        by_node.setdefault(cpu_node[device_key(d)], []).append(d)
    for node_id in sorted(by_node):
        cores = [c for c in view.node_cores[node_id] if c not in taken]
        engine_here = engine_on_rank0_node and cpu_node[device_key(rank0)] == node_id
        _plan_group(
            draft, f"node {node_id}", cores, by_node[node_id], engine_here, l3_of=view.cpu_l3
        )
    if global_members:
        _plan_group(draft, "global slice", block, global_members, engine_here=False)
    if settings.engine and (others or not rank0_numa) and draft.engine is None:
        # The engine comes out of the driver rank's own share (DeepInfer
        # carves the grammar-compiler pool from the driver GPU's quota), so
        # it never touches another device's share or slice either.
        share = draft.shares[device_key(rank0)]
        draft.shares[device_key(rank0)] = carve_engine(
            draft,
            share,
            1,
            f"rank 0's {draft.where[device_key(rank0)][0]}",
            lambda rest: roles_fit(settings, rest),
        )
    return strategies


def _home_allowed(view: HostView, d: Device) -> bool:
    """The node whose CPUs serve device `d` (its own, or for a CPU-less node the
    nearest with CPUs, cpuset aside) has allowed CPUs."""
    if d.numa_node is None:
        return False
    home = d.numa_node
    if home not in view.nodes_with_cpus:
        nearest = nearest_node(view, home, view.nodes_with_cpus)
        home = home if nearest is None else nearest
    return home in view.node_cores


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
    view: HostView, devices: Sequence[Device], settings: PlanSettings, warnings: list[str]
) -> dict[DeviceKey, DeviceStrategy]:
    """numa-affine or global-slice for each device that takes part in planning."""
    out: dict[DeviceKey, DeviceStrategy] = {}
    unknown: list[str] = []
    no_nodes = not view.node_cores  # no allowed CPU belongs to any NUMA node
    for d in devices:
        if settings.strategy == "global-slice":
            out[device_key(d)] = "global-slice"
        elif d.numa_node is not None and not no_nodes:
            out[device_key(d)] = "numa-affine"
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
            out[device_key(d)] = "global-slice"
            if d.visible:
                unknown.append(f"{d.label} ({d.bdf or 'no PCI address'})")
    if unknown:
        warnings.append(f"no known NUMA node for {', '.join(unknown)}: planned by global-slice")
    return out


# -- pools -------------------------------------------------------------------


def _global_block(
    view: HostView,
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


def _plan_group(
    draft: Draft,
    where: str,
    cores: list[Core],
    members: Sequence[Device],
    engine_here: bool,
    *,
    l3_of: Mapping[int, int] | None = None,
) -> None:
    """Split one node (or the global block) among its devices, engine first."""
    before = sum(len(c) for c in cores)
    if engine_here:

        def fits(rest: list[Core]) -> bool:
            shares = split_even(rest, len(members))
            return all(
                roles_fit(draft.settings, share)
                for d, share in zip(members, shares, strict=True)
                if d.visible
            )

        cores = carve_engine(draft, cores, len(members), f"{where} (rank 0's node)", fits)
    # Ranks that share a node get whole L3 domains where the counts allow.
    shares = split_by_l3(cores, len(members), l3_of or {})
    if cores and not all(roles_fit(draft.settings, sh) for sh in shares):
        # Whole cores leave a device short of its roles even by CPU (950's 3
        # CPUs per NPU with SMT): split by CPU, as the document's slices do.
        # Hidden devices count as visible ones do, so every supervisor on
        # the host decides alike.
        by_cpu = split_even(single_cpus(cores), len(members))
        if all(roles_fit(draft.settings, sh) for sh in by_cpu):
            shares = by_cpu
            draft.warnings.append(
                f"{where}: {len(cores)} cores cannot give each of {len(members)} devices its "
                "roles in whole cores; shares by CPU (SMT siblings split between ranks)"
            )
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
        draft.shares[device_key(d)] = shares[i]
        if where == "global slice":
            draft.where[device_key(d)] = (
                f"global slice {i} of {len(members)}",
                f"allowed CPUs: {total} over {len(members)} devices",
            )
        else:
            draft.where[device_key(d)] = (
                where,
                f"allowed CPUs on {where}: {counts} for {len(members)} devices",
            )


def _member_label(d: Device) -> str:
    return d.label if d.visible else f"{d.label} (hidden)"


# -- slots -------------------------------------------------------------------


def _rank_placement(
    view: HostView,
    draft: Draft,
    rank: int,
    devices: Sequence[Device],
    strategies: Mapping[DeviceKey, DeviceStrategy],
) -> RankPlacement:
    settings = draft.settings
    cores = sorted({c for d in devices for c in draft.shares[device_key(d)]})
    front = [(r, s) for r, s in settings.rank_roles.items() if r in FRONT_ROLES]
    back = [(r, s) for r, s in settings.rank_roles.items() if r not in FRONT_ROLES]
    roles = rank_roles(settings, cores)
    label = "+".join(d.label for d in devices)
    if roles is None:
        # Whole-core roles do not fit (950's acl and release at 3 CPUs per
        # NPU, a cpuset that splits SMT pairs): one CPU per role, as the
        # vLLM-Ascend document splits its pools, before any refusal.
        roles = rank_roles(settings, single_cpus(cores))
        if roles is not None and any(len(c) > 1 for c in cores):
            draft.warnings.append(
                f"rank {rank} ({label}): {sum(len(c) for c in cores)} CPUs ({len(cores)} "
                "cores) cannot hold its roles in whole cores; roles by CPU (SMT siblings "
                "split between roles)"
            )
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
        place = " + ".join(draft.where[device_key(d)][0] for d in devices)
        context = "; ".join(dict.fromkeys(draft.where[device_key(d)][1] for d in devices))
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
        mems.update(_device_mems(view, draft, d, strategies[device_key(d)]))
    kinds = {strategies[device_key(d)] for d in devices}
    strategy: Strategy = kinds.pop() if len(kinds) == 1 else "mixed"
    refs = tuple(DeviceRef(d.kind, d.index, d.bdf, d.numa_node, d.uuid) for d in devices)
    l3 = tuple(sorted({view.cpu_l3[c] for core in cores for c in core if c in view.cpu_l3}))
    return RankPlacement(
        l3_domains=l3,
        rank=rank,
        device=refs[0],
        slot=Slot(cpus_of(cores), tuple(sorted(mems)), {r: cpus_of(c) for r, c in roles.items()}),
        local_rank=rank,
        devices=refs if len(refs) > 1 else (),
        strategy=strategy,
    )


def _device_mems(view: HostView, draft: Draft, d: Device, strategy: DeviceStrategy) -> list[int]:
    """docs/contracts.md §3: the device's node, or for a CPU-less (HBM) device node the
    nearest node with CPUs; global-slice: the nodes of the slice's CPUs. Then
    kept inside the allowed mems (nearest allowed node with CPUs otherwise)."""
    if strategy == "numa-affine" and d.numa_node is not None:
        if d.numa_node in view.nodes_with_cpus:
            wanted = [d.numa_node]
        else:
            nearest = nearest_node(view, d.numa_node, view.nodes_with_cpus)
            wanted = [] if nearest is None else [nearest]
    else:
        share = draft.shares[device_key(d)]
        wanted = sorted({view.cpu_node.get(cpu, -1) for c in share for cpu in c} - {-1})
    allowed = view.allowed_mems
    ok = [n for n in wanted if n in allowed] if allowed else wanted
    if ok:
        return ok
    if view.mems_of_engine:
        # The engine's pages may only be on its container's nodes (the kernel places
        # new ones there). Moving them to another node would break that, and moving
        # them to a nearer allowed one gains nothing: they are already on those.
        draft.warnings.append(
            f"{d.label}: memory node {format_cpulist(wanted) or 'unknown'} is outside the "
            f"engine's cgroup cpuset.mems {format_cpulist(allowed)}; its memory is left "
            "where it is (no page moves)"
        )
        return []
    candidates = [n for n in (allowed or view.nodes) if n in view.nodes_with_cpus]
    start = wanted[0] if wanted else (d.numa_node if d.numa_node is not None else 0)
    nearest = nearest_node(view, start, candidates)
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
