"""IRQ planning on fixture hosts, and the keeper on fixture /proc/irq trees.

Real /proc/irq writes are in tests/watch/test_irqs_live.py; the multi-NUMA guest in
tests/watch/test_irqs_vm.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import IrqConfig
from supervisor.cpulist import format_cpulist
from supervisor.events import Recorder
from supervisor.examples.hosts import dgx_a100_nps4, dgx_h100, gb200_tray, no_accel_2node
from supervisor.hostfs import HostFS
from supervisor.plan.irqs import nic_functions, pair_nics, pci_proximity, plan_irqs, with_irqs
from supervisor.plan.placement import DeviceRef, Placement, PlanSettings, RankPlacement, Slot
from supervisor.plan.planner import plan
from supervisor.state import Observation, Snapshot, StateStore
from supervisor.topology.discover import read_topology
from supervisor.topology.model import Allowed, Cpu, Device, Irq, Nic, Node, Topology
from supervisor.watch.drift import diff
from supervisor.watch.irqs import IrqKeeper
from supervisor.watch.observe import read_irq_delivery
from tests.support.irqbalance import FakeIrqbalance, serve_fake_irqbalance


def _host(builder: Callable[[Path], Path], tmp_path: Path) -> tuple[Topology, Placement]:
    root = builder(tmp_path)
    topology = read_topology(HostFS(str(root)))
    return topology, plan(topology, PlanSettings())


# -- planning ----------------------------------------------------------------------


def test_dgx_h100_each_gpu_gets_its_own_hca_on_its_socket(tmp_path: Path) -> None:
    topology, placement = _host(dgx_h100, tmp_path)
    irqs = plan_irqs(topology, placement, nic=True)
    expected_hca = [
        "mlx5_0",
        "mlx5_3",
        "mlx5_4",
        "mlx5_5",
        "mlx5_6",
        "mlx5_9",
        "mlx5_10",
        "mlx5_11",
    ]
    nics = {f.bdf: f for f in nic_functions(topology.nics)}
    seen_nics: set[str] = set()
    for rank in placement.ranks:
        assignments = irqs[rank.rank]
        gpu = next(d for d in topology.devices if d.bdf == rank.device.bus_id)
        device_irqs = [a.irq for a in assignments if a.source == "device"]
        assert device_irqs == list(gpu.irqs)
        nic_owned = {a.bdf for a in assignments if a.source == "nic"}
        assert len(nic_owned) == 1
        (bdf,) = nic_owned
        assert bdf is not None
        assert nics[bdf].name == expected_hca[rank.rank]
        assert nics[bdf].numa_node == rank.device.numa_node
        assert [a.irq for a in assignments if a.source == "nic"] == list(nics[bdf].irqs)
        seen_nics.add(bdf)
        # Every IRQ goes to the rank's own irq CPUs, on the GPU's node.
        irq_cpus = tuple(sorted(rank.slot.roles["irq"]))
        assert all(a.cpus == irq_cpus for a in assignments)
        assert {topology.cpu(c).node for c in irq_cpus} == {rank.device.numa_node}
    assert len(seen_nics) == 8  # one HCA per GPU, none shared
    # The storage NICs (0000:29:00.x, 0000:aa:00.x) stay out of it.
    claimed = {a.irq for group in irqs.values() for a in group}
    for bdf in ("0000:29:00.0", "0000:29:00.1", "0000:aa:00.0", "0000:aa:00.1"):
        assert not claimed & set(nics[bdf].irqs)


def test_without_nic_only_device_irqs(tmp_path: Path) -> None:
    topology, placement = _host(dgx_h100, tmp_path)
    irqs = plan_irqs(topology, placement, nic=False)
    for rank in placement.ranks:
        assert [a.source for a in irqs[rank.rank]] == ["device"]


def test_nps4_pairs_by_node_not_by_gpu_order(tmp_path: Path) -> None:
    topology, placement = _host(dgx_a100_nps4, tmp_path)
    irqs = plan_irqs(topology, placement, nic=True)
    nodes = {f.bdf: f.numa_node for f in nic_functions(topology.nics)}
    names = {}
    for rank in placement.ranks:
        nic_bdfs = {a.bdf for a in irqs[rank.rank] if a.source == "nic"}
        assert len(nic_bdfs) == 1
        (bdf,) = nic_bdfs
        assert bdf is not None
        assert nodes[bdf] == rank.device.numa_node  # GPU0/1 on node 3 get node-3 HCAs
        names[rank.rank] = next(a.owner for a in irqs[rank.rank] if a.source == "nic")
    # Within a node, the HCA closest by PCI address: GPU 07 -> 0c, 0f -> 12.
    assert names == {i: f"mlx5_{i}" for i in range(8)}


def test_plan_is_deterministic(tmp_path: Path) -> None:
    topology, placement = _host(gb200_tray, tmp_path)
    first = plan_irqs(topology, placement, nic=True)
    again = plan_irqs(topology, placement, nic=True)
    assert dict(first) == dict(again)
    assert all(len({a.bdf for a in v if a.source == "nic"}) == 1 for v in first.values())


def test_cpu_standins_have_no_irqs_but_get_the_local_nic(tmp_path: Path) -> None:
    topology, placement = _host(no_accel_2node, tmp_path)
    irqs = plan_irqs(topology, placement, nic=True)
    by_node = {r.device.numa_node: irqs[r.rank] for r in placement.ranks}
    assert by_node[0] == ()  # no device IRQs, and the only NIC is on node 1
    assert [a.irq for a in by_node[1]] == [60, 61, 62]
    assert plan_irqs(topology, placement, nic=False) == {r.rank: () for r in placement.ranks}


def _topo(
    devices: list[Device], nics: list[Nic], cpus_per_node: int = 4, n_nodes: int = 2
) -> Topology:
    cpus = tuple(
        Cpu(i, i, i // cpus_per_node, 0, 0, i // cpus_per_node, frozenset({i}))
        for i in range(cpus_per_node * n_nodes)
    )
    nodes = tuple(
        Node(
            n,
            frozenset(range(n * cpus_per_node, (n + 1) * cpus_per_node)),
            1 << 30,
            tuple((m, 10 if m == n else 20) for m in range(n_nodes)),
        )
        for n in range(n_nodes)
    )
    online = frozenset(c.id for c in cpus)
    owners: list[tuple[str | None, tuple[int, ...]]] = [(d.bdf, d.irqs) for d in devices]
    owners += [(n.bdf, n.irqs) for n in nics]
    irqs = tuple(Irq(i, f"irq{i}", bdf) for bdf, numbers in owners for i in numbers)
    return Topology(
        cpus,
        online,
        online,
        nodes,
        Allowed(online, frozenset(range(n_nodes)), None, None),
        tuple(devices),
        tuple(nics),
        irqs,
    )


def _rank(
    rank: int, dev: Device, cpus: tuple[int, ...], irq_cpus: tuple[int, ...]
) -> RankPlacement:
    main = tuple(c for c in cpus if c not in irq_cpus)
    roles = {"irq": irq_cpus, "main": main} if irq_cpus else {"main": cpus}
    ref = DeviceRef(dev.kind, dev.index, dev.bdf, dev.numa_node)
    node = dev.numa_node if dev.numa_node is not None else 0
    return RankPlacement(rank, ref, Slot(cpus, (node,), roles))


def _gpu(i: int, bdf: str, node: int, irqs: tuple[int, ...]) -> Device:
    return Device("nvidia", i, bdf, node, "numa_node", irqs=irqs)


def test_fewer_nics_than_ranks_share_only_on_the_nic_s_node() -> None:
    gpus = [
        _gpu(0, "0000:10:00.0", 0, (10,)),
        _gpu(1, "0000:20:00.0", 0, (11,)),
        _gpu(2, "0000:90:00.0", 1, (12,)),
        _gpu(3, "0000:a0:00.0", 1, (13,)),
    ]
    nic = Nic("mlx5_0", "infiniband", "0000:98:00.0", 1, (50, 51, 52, 53))
    topology = _topo(gpus, [nic, Nic("ib0", "net", "0000:98:00.0", 1, (50, 51, 52, 53))])
    ranks = [_rank(i, g, (2 * i, 2 * i + 1), (2 * i,)) for i, g in enumerate(gpus)]
    placement = Placement("numa-affine", None, tuple(ranks))
    paired = pair_nics(topology, placement.ranks, nic_functions(topology.nics))
    assert set(paired) == {2, 3}  # node-0 ranks never take the node-1 NIC's IRQs
    irqs = plan_irqs(topology, placement, nic=True)
    assert [a.irq for a in irqs[0]] == [10]
    assert [a.irq for a in irqs[1]] == [11]
    # The two node-1 ranks split the NIC's four IRQs in contiguous runs.
    assert [a.irq for a in irqs[2]] == [12, 50, 51]
    assert [a.irq for a in irqs[3]] == [13, 52, 53]
    assert all(a.cpus == (4,) for a in irqs[2]) and all(a.cpus == (6,) for a in irqs[3])


def test_remote_nic_when_no_local_one_and_merged_roles_use_main() -> None:
    gpu = _gpu(0, "0000:10:00.0", 0, (10, 11))
    topology = _topo([gpu], [Nic("eth0", "net", "0000:90:00.0", 1, (60,))])
    rank = _rank(0, gpu, (0, 1, 2, 3), ())  # roles merged: main only
    irqs = plan_irqs(topology, Placement("numa-affine", None, (rank,)), nic=True)
    assert [(a.irq, a.source, a.cpus) for a in irqs[0]] == [
        (10, "device", (0, 1, 2, 3)),
        (11, "device", (0, 1, 2, 3)),
        (60, "nic", (0, 1, 2, 3)),
    ]


def test_a_nic_that_is_a_rank_s_device_is_not_paired_again() -> None:
    # The guest's case: config `devices = ["0000:41:00.0"]` names the node-1 NIC itself.
    dev = Device("pci", 0, "0000:41:00.0", 1, "numa_node", irqs=(30, 31))
    nics = [
        Nic("eth1", "net", "0000:41:00.0", 1, (30, 31)),
        Nic("eth0", "net", "0000:21:00.0", 0, (24,)),
    ]
    topology = _topo([dev], nics)
    rank = _rank(0, dev, (4, 5, 6, 7), (4,))
    irqs = plan_irqs(topology, Placement("numa-affine", None, (rank,)), nic=True)
    assert [(a.irq, a.source, a.owner) for a in irqs[0]] == [
        (24, "nic", "eth0"),  # the only other NIC, remote but the nearest there is
        (30, "device", "pci0"),
        (31, "device", "pci0"),
    ]


def test_pci_proximity() -> None:
    assert pci_proximity("0000:1b:00.0", "0000:18:00.0") == (0, 3, 0, 0)
    assert pci_proximity("0000:1b:00.0", "0001:1b:00.0") < pci_proximity(None, "0000:1b:00.0")
    assert pci_proximity("junk", "0000:18:00.0") == pci_proximity(None, None)


# -- the keeper on fixture trees --------------------------------------------------------


def _irq_tree(root: Path, irqs: dict[int, str], effective: dict[int, str] | None = None) -> None:
    for irq, cpus in irqs.items():
        d = root / f"proc/irq/{irq}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "smp_affinity_list").write_text(cpus + "\n")
        if effective is not None and irq in effective:
            (d / "effective_affinity_list").write_text(effective[irq] + "\n")


def _store(topology: Topology, placement: Placement) -> StateStore:
    return StateStore(Snapshot(placement, topology, {}))


def _recorded(keeper: IrqKeeper, store: StateStore) -> StateStore:
    """The keeper's facts recorded in `store`, as the daemon does on its loop."""
    Recorder(store).facts(keeper.take_facts())
    return store


def _planned(topology: Topology, placement: Placement, *, nic: bool) -> Placement:
    """`placement` with its IRQ plan, as the planner's last step makes it."""
    return with_irqs(topology, placement, PlanSettings(irq_nic=nic))


def _small_setup(*, nic: bool = True) -> tuple[Topology, Placement]:
    gpu = _gpu(0, "0000:10:00.0", 0, (40, 41))
    topology = _topo([gpu], [Nic("eth0", "net", "0000:12:00.0", 0, (42,))])
    rank = _rank(0, gpu, (0, 1, 2, 3), (1,))
    return topology, _planned(topology, Placement("numa-affine", None, (rank,)), nic=nic)


def _read(root: Path, irq: int) -> str:
    return (root / f"proc/irq/{irq}/smp_affinity_list").read_text().strip()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    _irq_tree(tmp_path, {40: "0-7", 41: "0-7", 42: "3"})
    (tmp_path / "proc/1").mkdir()
    (tmp_path / "proc/1/comm").write_text("init\n")
    return tmp_path


def test_keeper_apply_observe_enforce_restore(tree: Path) -> None:
    topology, placement = _small_setup()
    store = _store(topology, placement)
    keeper = IrqKeeper(HostFS(str(tree)), IrqConfig(nic=True))
    outcomes = keeper.apply(placement)
    assert [(o.irq, o.status, o.cpus) for o in outcomes] == [
        (40, "bound", (1,)),
        (41, "bound", (1,)),
        (42, "bound", (1,)),
    ]
    assert [_read(tree, i) for i in (40, 41, 42)] == ["1", "1", "1"]
    assert keeper.planned_irqs(placement, 0) == {40: (1,), 41: (1,), 42: (1,)}
    obs = keeper.observe(placement)[0]
    assert [(o.irq, o.cpus, o.planned) for o in obs] == [(i, (1,), (1,)) for i in (40, 41, 42)]
    assert diff(placement.ranks[0].slot, Observation(irqs=obs), threshold=0.0) == ()

    # Someone (not irqbalance: none runs here) moves IRQ 41.
    (tree / "proc/irq/41/smp_affinity_list").write_text("5\n")
    obs = keeper.observe(placement)[0]
    findings = diff(placement.ranks[0].slot, Observation(irqs=obs), threshold=0.0)
    assert [(f.kind, f.target, f.expected, f.actual) for f in findings] == [
        ("irq_affinity", "irq 41", "1", "5")
    ]
    moved = [e for e in _recorded(keeper, store).snapshot.events if e.kind == "irq_moved"]
    assert len(moved) == 1 and "irqbalance is not running" in moved[0].message
    keeper.observe(placement)  # the same move is reported once
    assert [e.kind for e in _recorded(keeper, store).snapshot.events].count("irq_moved") == 1

    fixed = keeper.enforce(0, placement)
    assert [(o.irq, o.status, o.cpus) for o in fixed] == [(41, "bound", (1,))]
    assert _read(tree, 41) == "1"
    assert keeper.enforce(0, placement) == ()  # nothing drifted any more
    # The keeper counts nothing: the check loop records the outcomes.
    assert _recorded(keeper, store).snapshot.counters.rebinds == {}

    results = keeper.restore()
    assert results == [(40, None), (41, None), (42, None)]
    assert [_read(tree, i) for i in (40, 41, 42)] == ["0-7", "0-7", "3"]
    assert any(e.kind == "irq_restored" for e in _recorded(keeper, store).snapshot.events)


def test_keeper_gone_irq_is_counted_once_and_not_observed_as_planned(tree: Path) -> None:
    gpu = _gpu(0, "0000:10:00.0", 0, (40, 77))  # 77 has no /proc/irq entry
    topology = _topo([gpu], [])
    placement = Placement("numa-affine", None, (_rank(0, gpu, (0, 1), (1,)),))
    placement = _planned(topology, placement, nic=False)
    store = _store(topology, placement)
    keeper = IrqKeeper(HostFS(str(tree)), IrqConfig())
    assert [(o.irq, o.status) for o in keeper.apply(placement)] == [(40, "bound"), (77, "gone")]
    keeper.apply(placement)
    assert _recorded(keeper, store).snapshot.counters.bind_failures == {("0", "irq", "gone"): 1}
    obs = keeper.observe(placement)[0]
    assert [(o.irq, o.cpus, o.planned) for o in obs] == [(40, (1,), (1,)), (77, (), ())]
    keeper.restore()


def test_disabled_config_touches_nothing(tree: Path) -> None:
    _, placement = _small_setup()
    keeper = IrqKeeper(HostFS(str(tree)), IrqConfig(enabled=False))
    assert keeper.apply(placement) == ()
    assert keeper.observe(placement) == {}
    assert _read(tree, 40) == "0-7"
    assert keeper.restore() == []


def test_stale_effective_affinity_reports_the_pending_target(tmp_path: Path) -> None:
    # After a write, x86 moves the vector at the next interrupt: an IRQ that has
    # not fired still shows its old effective CPU.
    _irq_tree(tmp_path, {40: "0", 41: "0-1", 42: "2"}, {40: "1", 41: "1", 42: "2"})
    fs = HostFS(str(tmp_path))
    assert read_irq_delivery(fs, 40) == (0,)  # stale effective 1: the next one goes to 0
    assert read_irq_delivery(fs, 41) == (1,)  # effective within the mask: the real target
    assert read_irq_delivery(fs, 42) == (2,)
    assert read_irq_delivery(fs, 99) is None


# -- irqbalance -------------------------------------------------------------------------


@pytest.fixture
def balanced_tree(tree: Path) -> Iterator[tuple[Path, FakeIrqbalance]]:
    server = serve_fake_irqbalance(tree, 4321)
    server.banned = [99]  # banned by someone else before we start
    yield tree, server
    server.close()


def test_ban_mode_bans_ours_keeps_others_and_gives_the_list_back(
    need_root: None, balanced_tree: tuple[Path, FakeIrqbalance]
) -> None:
    tree, server = balanced_tree
    topology, placement = _small_setup()
    store = _store(topology, placement)
    keeper = IrqKeeper(HostFS(str(tree)), IrqConfig(nic=True))
    keeper.apply(placement)
    assert keeper.irqbalance is not None and keeper.irqbalance.pid == 4321
    assert sorted(server.banned) == [40, 41, 42, 99]
    assert keeper.banned == {40, 41, 42}
    events = _recorded(keeper, store).snapshot.events
    assert any(e.kind == "irqbalance" and e.fields["banned"] for e in events)
    keeper.apply(placement)  # nothing new to ban: no second request
    assert sum(1 for r, _ in server.requests if r.startswith("settings")) == 1
    keeper.restore()
    assert server.banned == [99]
    assert _read(tree, 40) == "0-7"


def test_observe_mode_never_bans_and_names_irqbalance_on_a_move(
    need_root: None, balanced_tree: tuple[Path, FakeIrqbalance]
) -> None:
    tree, server = balanced_tree
    topology, placement = _small_setup()
    store = _store(topology, placement)
    config = IrqConfig(irqbalance="observe")
    keeper = IrqKeeper(HostFS(str(tree)), config)
    keeper.apply(placement)
    assert server.requests == []  # no ban, not even a query
    (tree / "proc/irq/40/smp_affinity_list").write_text("6\n")  # as irqbalance would
    obs = keeper.observe(placement)[0]
    assert (40, (6,), (1,)) in [(o.irq, o.cpus, o.planned) for o in obs]
    (moved,) = [e for e in _recorded(keeper, store).snapshot.events if e.kind == "irq_moved"]
    assert moved.fields["irqbalance"] == 4321 and "irqbalance (pid 4321)" in moved.message
    keeper.restore()
    assert server.banned == [99]


def test_unreachable_socket_falls_back_to_observing(tree: Path) -> None:
    (tree / "proc/555").mkdir()
    (tree / "proc/555/comm").write_text("irqbalance\n")  # running, but no socket
    topology, placement = _small_setup()
    store = _store(topology, placement)
    keeper = IrqKeeper(HostFS(str(tree)), IrqConfig())
    keeper.apply(placement)
    assert keeper.banned == frozenset()
    (event,) = [e for e in _recorded(keeper, store).snapshot.events if e.kind == "irqbalance"]
    assert event.fields["banned"] is False
    keeper.restore()


def test_the_keeper_never_writes_the_store_its_facts_are_recorded_on_the_loop(
    tree: Path,
) -> None:
    topology, placement = _small_setup()
    store = _store(topology, placement)
    writer_threads: set[int] = set()
    emit = store.emit

    def spy(*args: Any, **kwargs: Any) -> Any:
        writer_threads.add(threading.get_ident())
        return emit(*args, **kwargs)

    store.emit = spy  # type: ignore[method-assign]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        keeper = IrqKeeper(HostFS(str(tree)), IrqConfig(nic=True))
        with ThreadPoolExecutor(1) as pool:
            await loop.run_in_executor(pool, keeper.apply, placement)
            assert store.snapshot.events == ()  # the keeper holds no store
            Recorder(store).facts(keeper.take_facts())
            assert [e.kind for e in store.snapshot.events] == ["irq"]
            await loop.run_in_executor(pool, keeper.restore)
            Recorder(store).facts(keeper.take_facts())
        assert keeper.take_facts() == []  # taken once

    asyncio.run(main())
    assert writer_threads == {threading.get_ident()}  # only the loop's thread wrote
    assert [e.kind for e in store.snapshot.events] == ["irq", "irq_restored"]


def test_the_keeper_writes_exactly_the_placement_s_irq_plan(tmp_path: Path) -> None:
    # A DGX H100 with its HCAs: the plan's IRQs, less one, are all the keeper touches.
    root = dgx_h100(tmp_path)
    topology = read_topology(HostFS(str(root)))
    full = plan(topology, PlanSettings(irq_nic=True))
    every = {a.irq for r in full.ranks for a in r.irqs}
    _irq_tree(root, dict.fromkeys(every, "0-223"))
    (root / "proc/1").mkdir(exist_ok=True)
    (root / "proc/1/comm").write_text("init\n")
    rank = full.rank(3)
    dropped = rank.irqs[1].irq
    placement = replace(
        full,
        ranks=tuple(
            replace(r, irqs=tuple(a for a in r.irqs if a.irq != dropped)) if r is rank else r
            for r in full.ranks
        ),
    )
    keeper = IrqKeeper(HostFS(str(root)), IrqConfig(nic=True))
    outcomes = keeper.apply(placement)
    assert sorted(o.irq for o in outcomes) == sorted(every - {dropped})
    assert all(o.status == "bound" for o in outcomes)
    for r in placement.ranks:
        for a in r.irqs:
            assert _read(root, a.irq) == format_cpulist(a.cpus)
    assert _read(root, dropped) == "0-223"  # never written
    assert dropped not in {o.irq for o in keeper.observe(placement)[3]}
    # Moved by someone else, it is no drift of ours and enforce leaves it.
    (root / f"proc/irq/{dropped}/smp_affinity_list").write_text("7\n")
    assert keeper.enforce(3, placement) == ()
    assert _read(root, dropped) == "7"
    # A re-plan's placement is kept as it is: here the full plan, dropped IRQ included.
    again = keeper.apply(full)
    assert [o.irq for o in again if o.irq == dropped] == [dropped]
    assert _read(root, dropped) == format_cpulist(rank.irqs[1].cpus)
    keeper.restore()
    assert {_read(root, i) for i in every - {dropped}} == {"0-223"}
    assert _read(root, dropped) == "7"  # its original when the keeper first wrote it
