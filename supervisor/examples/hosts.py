"""Fixture hosts: one function per class of real machine (contracts §2), built with FakeHost.

Each takes a directory and returns the root of a new host tree under it
(`<dir>/<name>`; writes only there). The layouts follow public documentation
of these machines (vendor user guides, `numactl -H` / `nvidia-smi topo -m`
output published in them); each docstring says what is modelled and what had
to be assumed. `ALL_HOSTS` maps a short name to each builder, for tests that
iterate them; supervisor.examples.catalogue names them for `--example`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from supervisor.examples.builder import GIB, FakeHost


def dgx_h100(base: Path) -> Path:
    """NVIDIA DGX H100: 2x Xeon Platinum 8480C (56 cores, 112 threads each).

    224 CPUs; SMT siblings N and N+112; node 0 = 0-55,112-167, node 1 =
    56-111,168-223; 1 TiB per node. 8 H100 SXM at the bus ids of the DGX H100
    user guide (1b, 43, 52, 61 on socket 0; 9d, c3, d1, df on socket 1). 8
    ConnectX-7 compute HCAs mlx5_0,3,4,5,6,9,10,11 (ibp24s0 ... ibp220s0), one
    per GPU on the same socket, and 2 dual-port storage NICs (mlx5_1/2 on
    0000:29:00.x, mlx5_7/8 on 0000:aa:00.x). Assumed: storage NIC bus ids,
    distances 10/21, netdev names of the storage ports.
    """
    h = FakeHost(base / "dgx_h100").cpus(2, 56, 2, "intel", mem_per_node_bytes=1024 * GIB)
    h.distances([[10, 21], [21, 10]])
    gpus = ["1b", "43", "52", "61", "9d", "c3", "d1", "df"]
    for i, bus in enumerate(gpus):
        h.nvidia_gpu(
            f"0000:{bus}:00.0",
            0 if i < 4 else 1,
            uuid=f"GPU-{i:x}a1e4d5c-7b6a-4c1d-9e2f-0123456789{i:02d}",
        )
    hcas = [
        (0, "18"),
        (3, "40"),
        (4, "4f"),
        (5, "5e"),
        (6, "9a"),
        (9, "c0"),
        (10, "ce"),
        (11, "dc"),
    ]
    for k, (ib, bus) in enumerate(hcas):
        h.nic(f"0000:{bus}:00.0", 0 if k < 4 else 1, ib=f"mlx5_{ib}", netdev=f"ibp{int(bus, 16)}s0")
    for port_ib, bdf, node in [
        (1, "0000:29:00.0", 0),
        (2, "0000:29:00.1", 0),
        (7, "0000:aa:00.0", 1),
        (8, "0000:aa:00.1", 1),
    ]:
        port = bdf[-1]
        bus_no = int(bdf[5:7], 16)
        h.nic(
            bdf, node, ib=f"mlx5_{port_ib}", netdev=f"enp{bus_no}s0f{port}np{port}", device=0x1021
        )
    h.virtual_netdev("lo").virtual_netdev("docker0")
    return h.build()


def dgx_a100_nps4(base: Path) -> Path:
    """NVIDIA DGX A100: 2x AMD EPYC 7742 (64 cores, 128 threads each) in NPS4.

    8 NUMA nodes of 16 cores: node n = 16n..16n+15 and 128+16n..; siblings N
    and N+128; 128 GiB per node; distances 10 local, 12 same socket, 32
    remote. GPUs at the user guide's bus ids 07, 0f (node 3), 47, 4e (node
    1), 87, 90 (node 7), b7, bd (node 5): GPU order does not follow node
    order. HCAs mlx5_0-7 beside their GPU pairs; storage mlx5_8/9 on node 6.
    Assumed: HCA bus ids, storage NIC node.
    """
    h = FakeHost(base / "dgx_a100_nps4").cpus(
        2, 64, 2, "intel", nodes_per_socket=4, mem_per_node_bytes=128 * GIB
    )
    for i, (bus, node) in enumerate(
        [("07", 3), ("0f", 3), ("47", 1), ("4e", 1), ("87", 7), ("90", 7), ("b7", 5), ("bd", 5)]
    ):
        h.nvidia_gpu(f"0000:{bus}:00.0", node, model="NVIDIA A100-SXM4-80GB", uuid=f"GPU-a100{i}")
    for ib, (bus, node) in enumerate(
        [("0c", 3), ("12", 3), ("4b", 1), ("54", 1), ("8d", 7), ("94", 7), ("ba", 5), ("cc", 5)]
    ):
        h.nic(f"0000:{bus}:00.0", node, ib=f"mlx5_{ib}", netdev=f"ibp{int(bus, 16)}s0")
    h.nic("0000:e1:00.0", 6, ib="mlx5_8", netdev="enp225s0f0")
    h.nic("0000:e1:00.1", 6, ib="mlx5_9", netdev="enp225s0f1")
    h.virtual_netdev("lo")
    return h.build()


GB200_HBM_NODES = range(2, 18)


def gb200_tray(base: Path) -> Path:
    """NVIDIA GB200 compute tray: 2 Grace CPUs (72 Neoverse V2 cores, no SMT), 4 B200.

    Nodes 0 (CPUs 0-71) and 1 (72-143) hold the CPUs and 480 GiB LPDDR5X
    each. GPU memory appears as CPU-less NUMA nodes 2-17 (four per GPU, as the
    driver reserves for MIG); the first of each GPU's four, 2+4i, holds its
    ~186 GiB HBM, the others are empty. GPUs 0,1 report numa_node 0, GPUs 2,3
    numa_node 1 (PCI domains 0008, 0009, 0018, 0019). Assumed: distances (0-1
    = 40, CPU node to own GPU nodes 80, to others 120, GPU-GPU 120), bus ids,
    4 ConnectX-7 with one per GPU, cluster ids of 4 cores.
    """
    h = FakeHost(base / "gb200_tray").cpus(
        2, 72, 1, mem_per_node_bytes=480 * GIB, cores_per_cluster=4
    )
    for n in GB200_HBM_NODES:
        h.node(n, "", 186 * GIB if (n - 2) % 4 == 0 else 0)
    ids = [0, 1, *GB200_HBM_NODES]

    def owner(n: int) -> int:
        return n if n < 2 else (n - 2) // 4 // 2

    matrix = [
        [
            10 if a == b else 40 if a < 2 and b < 2 else 80 if owner(a) == owner(b) else 120
            for b in ids
        ]
        for a in ids
    ]
    h.distances(matrix)
    for i, dom in enumerate(["0008", "0009", "0018", "0019"]):
        h.nvidia_gpu(f"{dom}:01:00.0", i // 2, model="NVIDIA GB200", uuid=f"GPU-b200{i}")
    for i, dom in enumerate(["0000", "0002", "0010", "0012"]):
        h.nic(f"{dom}:03:00.0", i // 2, ib=f"mlx5_{i}", netdev=f"ibP{int(dom, 16)}p3s0")
    h.virtual_netdev("lo")
    return h.build()


NpuChip = tuple[int, int, int | None, str | None, str]
"""One row of `npu-smi info -m`: NPU id, chip id, logical id (None: "-"), bus id, chip name."""


def npu_smi_capture(h: FakeHost, chips: list[NpuChip], version: str = "24.1.rc2") -> FakeHost:
    """The operator's captures of `npu-smi info` and `npu-smi info -m` (the
    layout of public dumps), where the registry's record says to put them."""
    bar = "+" + "-" * 27 + "+" + "-" * 15 + "+" + "-" * 52 + "+"
    dbl = bar.replace("-", "=")

    def row(a: str, b: str, c: str) -> str:
        return f"| {a:<26}| {b:<14}| {c:<51}|"

    table = [
        bar,
        f"| {f'npu-smi {version}   Version: {version}':<94}|",
        bar,
        row("NPU   Name", "Health", "Power(W)    Temp(C)           Hugepages-Usage(page)"),
        row("Chip", "Bus-Id", "AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)"),
        dbl,
    ]
    npus = sorted({c[0] for c in chips})
    for npu in npus:
        mine = [c for c in chips if c[0] == npu and c[3] is not None]
        table.append(row(f"{npu}     {mine[0][4].split()[-1]}", "OK", "93.2        39"))
        for _, chip, _, bdf, _ in mine:
            table.append(row(str(chip), str(bdf).upper(), "0           0    / 0"))
        table.append(dbl)
    table += [
        row("NPU     Chip", "Process id", "Process name             | Process memory(MB)"),
        dbl,
        *(f"| {f'No running processes found in NPU {n}':<94}|" for n in npus),
        bar,
    ]
    header = f"{'':8}{'NPU ID':<31}{'Chip ID':<31}{'Chip Logic ID':<31}Chip Name"
    rows = [
        f"{'':8}{n:<31}{c:<31}{'-' if lid is None else lid:<31}{name}"
        for n, c, lid, _, name in chips
    ]
    where = "run/placement-supervisor/npu-smi"
    h.raw(f"{where}/info.txt", "\n".join(table) + "\n")
    h.raw(f"{where}/info-m.txt", "\n".join([header, *rows]) + "\n")
    return h


# Logical NPU id -> bus of an 8-NPU 910B (A2) server, as public `npu-smi info`
# dumps of Atlas 800T A2 hosts list them: not PCI bus order.
A2_BUSES = ("c1", "01", "c2", "02", "81", "41", "82", "42")
# Which quarter of the CPUs (socket) sits behind each bus's root port.
A2_SOCKET = {"01": 0, "02": 0, "41": 1, "42": 1, "81": 2, "82": 2, "c1": 3, "c2": 3}


def ascend_a2(base: Path, nodes_per_socket: int = 2, cpuset: str | None = None) -> Path:
    """Huawei Atlas 800T A2-class server: 4x Kunpeng 920 (48 cores, no SMT), 8 910B NPUs.

    192 CPUs; `nodes_per_socket` 2 gives 8 NUMA nodes of 24 CPUs (node 6 =
    144-167, the vLLM-Ascend CPU binding document's A2 example), 1 gives 4
    of 48. NPU logical ids 0-7 sit at buses C1, 01, C2, 02, 81, 41, 82, 42
    (public npu-smi dumps); NPU0 and NPU2 share socket 3's first node
    (144-167 with 8 nodes), NPU1/3 node 0, NPU5/7 socket 1, NPU4/6 socket 2.
    PCI numa_node and local_cpulist give that node (what `npu-smi info -t
    topo` reports as CPU Affinity). The npu-smi captures are in the tree.
    With `cpuset`, the process sits in cgroup v2 /system.slice/npu.service.
    Assumed: which root port each bus hangs off, 64 GiB per node, IRQ counts.
    """
    name = f"ascend_a2_{4 * nodes_per_socket}node"
    h = FakeHost(base / name).cpus(4, 48, 1, nodes_per_socket=nodes_per_socket)
    if cpuset is not None:
        h.cgroup_v2("/system.slice/npu.service", cpuset, f"0-{4 * nodes_per_socket - 1}")
    per_node = 48 // nodes_per_socket
    chips: list[NpuChip] = []
    for logical, bus in enumerate(A2_BUSES):
        node = A2_SOCKET[bus] * nodes_per_socket
        cpus = f"{node * per_node}-{node * per_node + per_node - 1}"
        h.pci_device(
            f"0000:{bus}:00.0",
            0x19E5,
            0xD802,
            0x120000,
            node,
            local_cpulist=cpus,
            irqs=h._alloc_irqs(2),
            driver="devdrv_device_driver",
            irq_names=["sq_send_trigger_irq", "cq_update_irq"],
        )
        h.dev_node(f"davinci{logical}")
        chips += [
            (logical, 0, logical, f"0000:{bus}:00.0", "Ascend 910B3"),
            (logical, 1, None, None, "Mcu"),
        ]
    h.dev_node("davinci_manager")
    npu_smi_capture(h, chips)
    h.virtual_netdev("lo")
    return h.build()


# Logical id -> bus of the A3 example's 16 dies (8 NPUs of 2 chips each). The
# lowest bus is logical 14, on socket 3: PCI order is not the runtime's.
A3_BUSES = (
    "9d",
    "9f",
    "99",
    "9b",
    "b9",
    "bb",
    "b5",
    "b7",
    "3d",
    "3f",
    "39",
    "3b",
    "19",
    "1b",
    "01",
    "03",
)


def ascend_a3(base: Path) -> Path:
    """Huawei Atlas 800T A3-class server: Kunpeng CPUs, 640 CPUs, 16 Ascend NPUs.

    4 sockets x 80 cores x 2 threads, adjacent SMT numbering (siblings 0,1),
    2 NUMA nodes per socket (8 nodes of 80 CPUs, 256 GiB each). 8 NPUs of
    two dies each: 16 logical NPUs (19e5:d803, class 0x1200,
    dev/davinci0-15), four per socket by logical id; `npu-smi info -m`
    numbers die c of NPU n as logical 2n + c, and the captures of it and of
    `npu-smi info` are in the tree. Bus ids are not in logical order
    (A3_BUSES: the lowest, 01, is logical 14). Each NPU has a ubcore entry
    (in logical order) whose device/numa gives the coarse node 2*socket,
    folded by `(raw // 2) * 2 + index % 2` onto the socket's two nodes; the
    PCI numa_node also says the coarse node. A ubcore entry with ub_totalues
    0 (udma8) sits between NPU 7 and NPU 8 and must be skipped. Assumed:
    exact CPU counts per socket, bus ids and their order, raw ubcore values.
    """
    h = FakeHost(base / "ascend_a3").cpus(
        4, 80, 2, "adjacent", nodes_per_socket=2, mem_per_node_bytes=256 * GIB
    )
    chips: list[NpuChip] = []
    for i, bus in enumerate(A3_BUSES):
        socket = i // 4
        h.ascend_npu(f"0000:{bus}:00.0", 2 * socket, ubcore_numa=2 * socket)
        chips.append((i // 2, i % 2, i, f"0000:{bus}:00.0", "Ascend910"))
        if i % 2:
            chips.append((i // 2, 2, None, None, "Mcu"))
        if i == 7:
            h.ubcore_entry("udma8", 0, 0)
    npu_smi_capture(h, chips)
    h.virtual_netdev("lo")
    return h.build()


def epyc_nps1_8gpu(base: Path, ccds: int = 8) -> Path:
    """A single-socket EPYC (64 cores, 128 threads: siblings N and N+64) in NPS1
    with 8 GPUs, all on node 0. `ccds` L3 domains (CCDs) of 64 / ccds cores
    each, in core order, as cache/index3/shared_cpu_list lists them (8 for a
    64-core Milan/Genoa part). Assumed: bus ids, one GPU per root port.
    """
    h = FakeHost(base / f"epyc_nps1_{ccds}ccd").cpus(
        1, 64, 2, "intel", mem_per_node_bytes=768 * GIB
    )
    h.l3(64 // ccds)
    for i, bus in enumerate(["01", "21", "41", "61", "81", "a1", "c1", "e1"]):
        h.nvidia_gpu(f"0000:{bus}:00.0", 0, model="NVIDIA L40S", uuid=f"GPU-epyc{i}")
    h.virtual_netdev("lo")
    return h.build()


def mi300x(base: Path) -> Path:
    """AMD Instinct MI300X platform: 2x EPYC 9654 (96 cores, 192 threads), NPS1.

    384 CPUs, siblings N and N+192, 2 nodes of 768 GiB. 8 MI300X OAM GPUs
    (1002:74a1, class 0x120000, driver amdgpu, dev/kfd), four per socket,
    each behind an AMD PCIe switch whose upstream bridge is also vendor 1002
    (class 0x060400). Also an ASPEED AST2600 BMC display (1a03:2000, class
    0x030000, driver ast) and an AMD display function with no compute driver
    (1002:1478, class 0x038000, unbound): neither is an accelerator. Assumed:
    bus ids, the unbound AMD display function.
    """
    h = FakeHost(base / "mi300x").cpus(2, 96, 2, "intel", mem_per_node_bytes=768 * GIB)
    h.distances([[10, 32], [32, 10]])
    for i, bus in enumerate(["05", "26", "46", "65", "85", "a6", "c6", "e5"]):
        node = 0 if i < 4 else 1
        h.amd_gpu(f"0000:{bus}:00.0", node)
        up = f"0000:{int(bus, 16) - 2:02x}:00.0"
        h.pci_device(up, 0x1002, 0x14A0, 0x060400, node)
    h.pci_device("0000:c2:00.0", 0x1A03, 0x2000, 0x030000, 1, driver="ast")
    h.pci_device("0000:e8:00.0", 0x1002, 0x1478, 0x038000, 1)
    for i, bus in enumerate(["0c", "2c", "4c", "6c", "8c", "ac", "cc", "ec"]):
        h.nic(f"0000:{bus}:00.0", 0 if i < 4 else 1, ib=f"mlx5_{i}", netdev=f"ibp{int(bus, 16)}s0")
    h.virtual_netdev("lo")
    return h.build()


def five_three(base: Path) -> Path:
    """Asymmetric PCIe: 2x 32-core/64-thread sockets, 5 GPUs on socket 0, 3 on socket 1.

    128 CPUs (siblings N, N+64), 2 nodes of 256 GiB; NVIDIA L40S-class GPUs at
    18, 2a, 3a, 4a, 5a (node 0) and 9a, ca, da (node 1). Assumed: all of it
    (this models a class of machine, not one product).
    """
    h = FakeHost(base / "five_three").cpus(2, 32, 2, "intel", mem_per_node_bytes=256 * GIB)
    for i, bus in enumerate(["18", "2a", "3a", "4a", "5a", "9a", "ca", "da"]):
        h.nvidia_gpu(f"0000:{bus}:00.0", 0 if i < 5 else 1, model="NVIDIA L40S")
    h.virtual_netdev("lo")
    return h.build()


def adjacent_smt(base: Path) -> Path:
    """SMT siblings numbered adjacently (0,1 / 2,3 ...), as some AMD and ARM firmware does.

    2 sockets x 16 cores x 2 threads: node 0 = CPUs 0-31, node 1 = 32-63; two
    GPUs, one per node. Assumed: everything but the numbering.
    """
    h = FakeHost(base / "adjacent_smt").cpus(2, 16, 2, "adjacent")
    h.nvidia_gpu("0000:41:00.0", 0, model="NVIDIA L40S")
    h.nvidia_gpu("0000:c1:00.0", 1, model="NVIDIA L40S")
    return h.build()


CONTAINER_ALLOWED = "2-5,9,12-19,30-37,40-43"
TIGHT_CONTAINER_ALLOWED = "2-5,9,12-15,40-43"


def container_holes(base: Path, allowed: str = CONTAINER_ALLOWED) -> Path:
    """A container whose cgroup v2 cpuset is a non-contiguous subset: 2-5,9,12-19,30-37,40-43.

    Host: 2 sockets x 24 cores x 2 threads (node 0 = 0-23,48-71, node 1 =
    24-47,72-95), 4 GPUs, two per node. The process's affinity (status) is
    still all CPUs; cgroup /kubepods.slice/pod-a/cri-b has
    cpuset.cpus.effective as given and mems 0-1. Siblings of the allowed
    CPUs (50-53, ...) are outside the set, so each allowed CPU is a core of
    its own to the planner.
    """
    h = FakeHost(base / "container_holes").cpus(2, 24, 2, "intel")
    h.cgroup_v2("/kubepods.slice/pod-a/cri-b", allowed, "0-1")
    for i, bus in enumerate(["18", "3b", "86", "af"]):
        h.nvidia_gpu(f"0000:{bus}:00.0", 0 if i < 2 else 1, model="NVIDIA A10")
    h.virtual_netdev("lo")
    return h.build()


def tight_container(base: Path) -> Path:
    """The same container squeezed to 2-5,9,12-15,40-43: node 1 keeps 4 CPUs for
    2 GPUs, too few for irq + comm + main each (the shortage cases)."""
    return container_holes(base, TIGHT_CONTAINER_ALLOWED)


def numa_unknown(base: Path) -> Path:
    """GPUs whose PCI numa_node is -1 (firmware gives no proximity).

    2 sockets x 16 cores x 2 threads (node 0 = 0-15,32-47; node 1 = 16-31,48-63).
    GPU 0000:3b:00.0: numa_node -1 but local_cpulist 16-31,48-63 (node 1).
    GPU 0000:5e:00.0: numa_node -1 and local_cpulist = all CPUs -> unknown.
    GPU 0000:af:00.0: numa_node 0 (a normal one).
    """
    h = FakeHost(base / "numa_unknown").cpus(2, 16, 2, "intel")
    h.nvidia_gpu("0000:3b:00.0", -1, local_cpulist="16-31,48-63", model="NVIDIA A10")
    h.nvidia_gpu("0000:5e:00.0", -1, local_cpulist="0-63", model="NVIDIA A10")
    h.nvidia_gpu("0000:af:00.0", 0, model="NVIDIA A10")
    return h.build()


def no_accel_2node(base: Path) -> Path:
    """A 2-socket host without accelerators: 2 x 8 cores x 2 threads, 2 nodes.

    One Intel X710 port (eth0, 0000:3b:00.0, node 1) with i40e-named IRQs,
    plus lo and a bridge without device links.
    """
    h = FakeHost(base / "no_accel_2node").cpus(2, 8, 2, "intel")
    h.pci_device(
        "0000:3b:00.0",
        0x8086,
        0x1572,
        0x020000,
        1,
        irqs=[60, 61, 62],
        driver="i40e",
        irq_names=["i40e-0000:3b:00.0:misc", "i40e-eth0-TxRx-0", "i40e-eth0-TxRx-1"],
    )
    h.netdev("eth0", "0000:3b:00.0")
    h.virtual_netdev("lo").virtual_netdev("br0")
    return h.build()


UUID_CONTAINER_UUIDS = tuple(f"GPU-{i:x}3f0c9e2-55aa-4b7d-8e61-d0c1a2b3c4{i:02d}" for i in range(8))
UUID_CONTAINER_ORDER = (6, 1, 5, 2)
UUID_CONTAINER_VISIBLE = ",".join(UUID_CONTAINER_UUIDS[i] for i in UUID_CONTAINER_ORDER)
UUID_CONTAINER_CPUS = "8-31,40-63,72-95,104-127"


def container_uuid(base: Path) -> Path:
    """A container that is told its GPUs by UUID, not in index order.

    Run with CUDA_VISIBLE_DEVICES = UUID_CONTAINER_VISIBLE: the UUIDs of GPU
    6, 1, 5, 2 in that order (a launcher hands out GPUs as it frees them), so
    cuda:0 / LOCAL_RANK 0 is GPU 6 on node 1 and cuda:1 is GPU 1 on node 0.
    Host: 2 sockets x 32 cores x 2 threads, node 0 = 0-31,64-95, node 1 =
    32-63,96-127, 512 GiB each, distances 10/21; 8 H100 at 18, 2a, 3a, 5d
    (node 0) and 9a, ab, ba, db (node 1), UUIDs UUID_CONTAINER_UUIDS. The
    driver's procfs lists all 8 (a pod granted every GPU, as one that runs
    two servers is); the process sits in cgroup v2
    /kubepods.slice/kubepods-pod7.slice/cri-containerd-5e1f.scope with the
    cpuset UUID_CONTAINER_CPUS (cores 8-31 of each socket and their
    siblings), mems 0-1. Assumed: bus ids, UUIDs, cpuset, the visible order.
    """
    h = FakeHost(base / "container_uuid").cpus(2, 32, 2, "intel", mem_per_node_bytes=512 * GIB)
    h.distances([[10, 21], [21, 10]])
    h.cgroup_v2(
        "/kubepods.slice/kubepods-pod7.slice/cri-containerd-5e1f.scope", UUID_CONTAINER_CPUS, "0-1"
    )
    for i, bus in enumerate(["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]):
        h.nvidia_gpu(f"0000:{bus}:00.0", 0 if i < 4 else 1, uuid=UUID_CONTAINER_UUIDS[i])
    h.virtual_netdev("lo").virtual_netdev("eth0")
    return h.build()


SNC3_GPU_NODES = (0, 2, 3, 5)


def xeon6_snc3_b200(base: Path, cpuset: str | None = None) -> Path:
    """An 8x B200 HGX host on 2x Xeon 6 6960P (72 cores, 144 threads each) in SNC3.

    Each socket is three sub-NUMA nodes of 24 cores: node n = 24n..24n+23
    and 144+24n.. (siblings N and N+144), 256 GiB each; nodes 0-2 on socket
    0, 3-5 on socket 1. The GPUs' PCIe switches hang off root ports in the
    outer sub-NUMA clusters: two B200 each on nodes 0, 2, 3 and 5, none on
    nodes 1 and 4. Distances 10 local, 12 within a socket, 21 across (the
    SLIT Xeon 6 reports in SNC mode). A ConnectX-7 beside each GPU. With
    `cpuset`, the process sits in cgroup v2 /system.slice/llm.service with
    that cpuset and mems 0-5. Assumed: bus ids, which cluster each root port
    sits in, one distance for all pairs within a socket.
    """
    h = FakeHost(base / "xeon6_snc3_b200").cpus(
        2, 72, 2, "intel", nodes_per_socket=3, mem_per_node_bytes=256 * GIB
    )
    h.distances(
        [[10 if a == b else 12 if a // 3 == b // 3 else 21 for b in range(6)] for a in range(6)]
    )
    if cpuset is not None:
        h.cgroup_v2("/system.slice/llm.service", cpuset, "0-5")
    buses = ["1a", "2b", "5d", "6e", "9a", "ab", "db", "ec"]
    for i, bus in enumerate(buses):
        node = SNC3_GPU_NODES[i // 2]
        h.nvidia_gpu(f"0000:{bus}:00.0", node, model="NVIDIA B200", uuid=f"GPU-b200{i}e6d")
        nic = f"0000:{int(bus, 16) + 1:02x}:00.0"
        h.nic(nic, node, ib=f"mlx5_{i}", netdev=f"ibp{int(bus, 16) + 1}s0")
    h.virtual_netdev("lo")
    return h.build()


ALL_HOSTS: dict[str, Callable[[Path], Path]] = {
    "dgx_h100": dgx_h100,
    "dgx_a100_nps4": dgx_a100_nps4,
    "gb200_tray": gb200_tray,
    "ascend_a3": ascend_a3,
    "ascend_a2": ascend_a2,
    "mi300x": mi300x,
    "epyc_nps1_8gpu": epyc_nps1_8gpu,
    "five_three": five_three,
    "adjacent_smt": adjacent_smt,
    "container_holes": container_holes,
    "numa_unknown": numa_unknown,
    "no_accel_2node": no_accel_2node,
    "container_uuid": container_uuid,
    "xeon6_snc3_b200": xeon6_snc3_b200,
}
