"""Cutting whole cores into roles, and the engine's slot (pure, no I/O; planner-internal).

A rank's pool and the engine's slot are split into roles in whole cores:
`irq` from the front, other sized roles from the end, `main` the middle
(`split_roles`). `carve_engine` takes the engine's slot from a node's end,
giving way to the ranks; `find_engine_node` looks for a device-free node for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from supervisor.errors import PlanError
from supervisor.plan.placement import PlanSettings
from supervisor.plan.view import (
    Core,
    Draft,
    HostView,
    count_cpus,
    nearest_cpu_node,
    nearest_node,
    node_distance,
)
from supervisor.topology.model import Device

# Where a rank's roles sit inside its pool. `irq` takes the pool's first cores:
# a rank's pool starts at its share's first core, and the node's first CPU is
# where unmovable housekeeping (the boot CPU's timers, legacy and managed IRQs)
# already runs (Documentation/admin-guide/kernel-per-CPU-kthreads.rst), so the
# interrupt role is the one that loses least by sitting there. Every other
# sized role (comm, ...) takes cores from the pool's end, in the order the
# settings list them, like vllm-ascend's pool[-2]/pool[-1] split; `main` keeps
# the contiguous middle.
FRONT_ROLES = ("irq",)
T = TypeVar("T")


def split_even(cores: Sequence[T], count: int) -> list[list[T]]:
    """`count` contiguous shares of whole cores (or anything); earlier shares get one more."""
    base, extra = divmod(len(cores), count)
    shares: list[list[T]] = []
    start = 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        shares.append(list(cores[start : start + size]))
        start += size
    return shares


def split_by_l3(cores: Sequence[Core], count: int, l3_of: Mapping[int, int]) -> list[list[Core]]:
    """`count` shares of whole cores that split no L3 domain where one can help it.

    Domains in core order. With at least as many domains as shares, each
    share is a run of whole domains (divmod of the domains, earlier shares
    one more); with fewer, each domain goes to a run of shares (divmod of
    the shares, earlier domains one more) and is split evenly among them,
    so no share spans two domains. As the kubelet's
    prefer-align-cpus-by-uncorecache and torchrun's core-complex binding
    align to the L3. Where any core's L3 is unknown, or all are one: even
    contiguous shares (split_even).
    """
    domains: dict[int, list[Core]] = {}
    for core in cores:
        domain = l3_of.get(core[0])
        if domain is None:
            return split_even(cores, count)
        domains.setdefault(domain, []).append(core)
    runs = list(domains.values())
    if len(runs) <= 1 or count <= 1:
        return split_even(cores, count)
    if len(runs) >= count:
        return [[c for run in group for c in run] for group in split_even(runs, count)]
    shares: list[list[Core]] = []
    for run, ranks in zip(runs, (len(g) for g in split_even(range(count), len(runs))), strict=True):
        shares += split_even(run, ranks)
    return shares


def engine_sizes(settings: PlanSettings) -> list[tuple[str, int]]:
    return [("main", settings.engine_main_cpus), *settings.engine_roles.items()]


def rank_roles(settings: PlanSettings, cores: Sequence[Core]) -> dict[str, list[Core]] | None:
    """A rank's roles in `cores`, or None when they do not fit."""
    front = [(r, s) for r, s in settings.rank_roles.items() if r in FRONT_ROLES]
    back = [(r, s) for r, s in settings.rank_roles.items() if r not in FRONT_ROLES]
    return split_roles(cores, front, back, settings.min_main_cpus)


def single_cpus(cores: Sequence[Core]) -> list[Core]:
    """Each CPU of `cores` on its own: roles by CPU, as vLLM-Ascend's
    document splits a pool (pool[0:2], pool[2:-2], pool[-2], pool[-1])."""
    return [(c,) for core in cores for c in core]


def roles_fit(settings: PlanSettings, cores: Sequence[Core]) -> bool:
    """A rank's roles fit in `cores`, in whole cores or else by CPU."""
    return (
        rank_roles(settings, cores) is not None
        or rank_roles(settings, single_cpus(cores)) is not None
    )


def carve_engine(
    draft: Draft,
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
    names = " + ".join(f"{r} {s}" for r, s in engine_sizes(settings) if s > 0)
    have = sum(len(c) for c in cores)
    full = take_from_end(cores, engine_sizes(settings))
    candidates = [
        n
        for n in (full, take_from_end(cores, [("main", settings.engine_main_cpus)]), 1)
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
            roles = split_roles(
                cores, [], list(settings.engine_roles.items()), settings.engine_main_cpus
            ) or split_roles(cores, [], one_each, 1)
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
        roles = split_roles(
            engine, [], list(settings.engine_roles.items()), settings.engine_main_cpus
        )
    if roles is None:
        draft.warnings.append(
            f"engine: {where} has {have} allowed CPUs, too few for the engine's {names} "
            f"besides the ranks' roles; engine roles merged into main "
            f"({count_cpus(engine)})"
        )
    draft.engine = engine
    draft.engine_roles = roles if roles is not None else {"main": engine}
    return cores[: len(cores) - count]


def find_engine_node(
    view: HostView, settings: PlanSettings, devices: Sequence[Device], rank0_node: int
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
    homes = {nearest_cpu_node(view, d.numa_node) for d in devices if d.numa_node is not None}
    sizes = engine_sizes(settings)
    free = [
        n
        for n, cores in view.node_cores.items()
        if n not in homes and take_from_end(cores, sizes) is not None
    ]
    return nearest_node(view, rank0_node, free)


def place_engine_apart(view: HostView, draft: Draft, rank0_node: int) -> None:
    """The engine's slot from the end of its device-free node, roles as configured."""
    node = draft.engine_node
    assert node is not None
    cores = list(view.node_cores[node])
    distance = node_distance(view, rank0_node, node)
    carve_engine(draft, cores, 0, f"node {node}", lambda rest: True)
    draft.warnings.append(
        f"engine: on node {node}, which has no device (nearest to rank 0's node "
        f"{rank0_node}, distance {distance:g}); the ranks keep all of their nodes' CPUs"
    )


def place_engine_share(
    view: HostView, draft: Draft, rank0_node: int, devices: Sequence[Device]
) -> bool:
    """With other supervisors on the host: the engine on its device-free node,
    but only in this supervisor's part of it. The node's cores are split among
    every device of the kind (`devices`, visible or hidden, host order), and
    the engine takes its slot from the end of the parts of its own visible
    devices, so engines of supervisors that see different devices never
    meet. False (nothing placed) when those parts are empty."""
    node = draft.engine_node
    assert node is not None
    parts = split_even(view.node_cores[node], len(devices))
    own = [core for d, part in zip(devices, parts, strict=True) if d.visible for core in part]
    if not own:
        draft.engine_node = None
        return False
    carve_engine(draft, own, 0, f"node {node} (this supervisor's part)", lambda rest: True)
    distance = node_distance(view, rank0_node, node)
    draft.warnings.append(
        f"engine: on node {node}, which has no device (nearest to rank 0's node "
        f"{rank0_node}, distance {distance:g}), in its devices' part of that node "
        f"({len(own)} of {len(view.node_cores[node])} cores; other supervisors on this "
        "host take the rest); the ranks keep all of their nodes' CPUs"
    )
    return True


def engine_mems(
    view: HostView, engine_node: int | None, rank0_mems: tuple[int, ...]
) -> tuple[int, ...]:
    """The engine's memory: its own node when it sits apart (where allowed),
    else rank 0's nodes (docs/contracts.md §3)."""
    if engine_node is not None and (not view.allowed_mems or engine_node in view.allowed_mems):
        return (engine_node,)
    return rank0_mems


def take_from_end(cores: Sequence[Core], sizes: Sequence[tuple[str, int]]) -> int | None:
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


def split_roles(
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
