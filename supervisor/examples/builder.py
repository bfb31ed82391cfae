"""FakeHost: a fluent builder that writes a host tree of real Linux-format files.

The tree holds exactly the files discovery reads (docs/contracts.md §2): sysfs CPU and
node directories, /proc/self/{status,cgroup}, cgroup cpuset files, PCI device
directories, the NVIDIA procfs information files, /dev nodes (as empty
files), ubcore entries, InfiniBand/net class links and /proc/interrupts.
Nothing is written until `build()`, and then only under the builder's own
root (it reads nothing of this host); `raw()` and `remove()` then let a test
garble or drop any single file. The named hosts (`--example`) and the tests
build their trees with it. Over 500 lines because it is one fluent class:
each setter sits with the writer of the files it shapes, and the file formats
must agree with each other (node cpulists with CPU topology, msi_irqs with
/proc/interrupts), which a split would put in two places.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from supervisor.cpulist import format_cpulist, format_mask, parse_cpulist

SmtNumbering = Literal["intel", "adjacent"]

GIB = 1 << 30


@dataclass(slots=True)
class _Cpu:
    core: int
    package: int
    die: int
    cluster: int


@dataclass(slots=True)
class _Node:
    cpus: set[int]
    mem_bytes: int


@dataclass(slots=True)
class _Pci:
    vendor: int
    device: int
    class_: int
    numa_node: int | str
    local_cpulist: str | None
    irqs: list[int]
    driver: str | None


@dataclass(slots=True)
class _Irq:
    number: int
    chip: str
    hwirq: str
    name: str


@dataclass(slots=True)
class _Cgroup:
    version: Literal[1, 2]
    path: str
    cpus: str
    mems: str
    hybrid: bool


@dataclass(slots=True)
class _Nvidia:
    uuid: str
    model: str
    proc_entry: bool


@dataclass(slots=True)
class _Ubcore:
    name: str
    total_ues: int
    numa: int


@dataclass(slots=True)
class FakeHost:
    """Builder for one fake host under `root`. Methods return self for chaining."""

    root: Path
    _cpus: dict[int, _Cpu] = field(default_factory=dict)
    _threads: dict[int, set[int]] = field(default_factory=dict)  # cpu -> its core's cpus
    _nodes: dict[int, _Node] = field(default_factory=dict)
    _distances: list[list[int]] | None = None
    _offline: set[int] = field(default_factory=set)
    _possible_extra: int = 0
    _old_topology: bool = False
    _numa_dirs: bool = True
    _allowed_cpus: str | None = None
    _allowed_mems: str | None = None
    _cgroup: _Cgroup | None = None
    _pci: dict[str, _Pci] = field(default_factory=dict)
    _nvidia: dict[str, _Nvidia] = field(default_factory=dict)
    _dev: set[str] = field(default_factory=set)
    _ubcore: list[_Ubcore] = field(default_factory=list)
    _ib: dict[str, str] = field(default_factory=dict)  # ib name -> bdf
    _net: dict[str, str | None] = field(default_factory=dict)  # netdev -> bdf (None: virtual)
    _irqs: list[_Irq] = field(default_factory=list)
    _raw: dict[str, str] = field(default_factory=dict)
    _removed: set[str] = field(default_factory=set)
    _next_irq: int = 100
    _l3_cores: int = 0  # cores per L3 domain (0: no cache/ files)

    # -- CPUs and nodes ------------------------------------------------------

    def cpus(
        self,
        n_sockets: int,
        cores_per_socket: int,
        threads_per_core: int = 1,
        smt_numbering: SmtNumbering = "intel",
        *,
        nodes_per_socket: int = 1,
        mem_per_node_bytes: int = 64 * GIB,
        cores_per_cluster: int | None = None,
    ) -> FakeHost:
        """Sockets of cores of SMT threads, each socket split into equal NUMA nodes.

        "intel" numbering gives thread t of core c the id c + t * all_cores (Linux
        on Intel/AMD x86 enumerates first threads of every core first);
        "adjacent" gives c * threads + t (siblings 0,1 / 2,3, as on some ARM).
        Node ids are socket * nodes_per_socket + k; core ids restart per socket.
        """
        total_cores = n_sockets * cores_per_socket
        per_node = cores_per_socket // nodes_per_socket
        for s in range(n_sockets):
            for c in range(cores_per_socket):
                gcore = s * cores_per_socket + c
                ids = [
                    gcore + t * total_cores
                    if smt_numbering == "intel"
                    else gcore * threads_per_core + t
                    for t in range(threads_per_core)
                ]
                cluster = c // cores_per_cluster if cores_per_cluster else 65535
                node = s * nodes_per_socket + min(c // per_node, nodes_per_socket - 1)
                for cpu in ids:
                    self._cpus[cpu] = _Cpu(core=c, package=s, die=0, cluster=cluster)
                    self._threads[cpu] = set(ids)
                    self._nodes.setdefault(node, _Node(set(), mem_per_node_bytes)).cpus.add(cpu)
        return self

    def l3(self, cores_per_l3: int) -> FakeHost:
        """cache/index3 files: each run of `cores_per_l3` cores of a socket shares an L3."""
        self._l3_cores = cores_per_l3
        return self

    def node(self, node_id: int, cpus: str = "", mem_bytes: int = 0) -> FakeHost:
        """Add or replace a node (e.g. a CPU-less HBM/CXL node: cpus="")."""
        self._nodes[node_id] = _Node(set(parse_cpulist(cpus)), mem_bytes)
        return self

    def distances(self, matrix: list[list[int]]) -> FakeHost:
        """SLIT rows in node order (default: 10 local, 12 same socket, 32 remote)."""
        self._distances = matrix
        return self

    def offline(self, *cpus: int) -> FakeHost:
        self._offline.update(cpus)
        return self

    def possible_extra(self, n: int) -> FakeHost:
        """Make cpu/possible n ids wider than present (hot-pluggable slots)."""
        self._possible_extra = n
        return self

    def old_topology(self) -> FakeHost:
        """Write only core_id, physical_package_id, thread_siblings_list (pre-5.x kernels)."""
        self._old_topology = True
        return self

    def no_numa(self) -> FakeHost:
        """No sys/devices/system/node at all (CONFIG_NUMA=n)."""
        self._numa_dirs = False
        return self

    # -- allowed set -----------------------------------------------------------

    def allowed(self, cpus: str, mems: str) -> FakeHost:
        """Cpus_allowed_list / Mems_allowed_list of proc/self/status."""
        self._allowed_cpus = cpus
        self._allowed_mems = mems
        return self

    def cgroup_v2(self, path: str, cpus: str, mems: str) -> FakeHost:
        """The process sits in cgroup2 `path` whose effective cpuset is cpus/mems."""
        self._cgroup = _Cgroup(2, path, cpus, mems, hybrid=False)
        return self

    def cgroup_v1(self, path: str, cpus: str, mems: str, *, hybrid: bool = True) -> FakeHost:
        """v1 cpuset hierarchy at sys/fs/cgroup/cpuset; hybrid adds an empty unified v2."""
        self._cgroup = _Cgroup(1, path, cpus, mems, hybrid=hybrid)
        return self

    # -- PCI devices -------------------------------------------------------------

    def pci_device(
        self,
        bdf: str,
        vendor: int,
        device: int,
        class_: int,
        numa_node: int | str = -1,
        *,
        irqs: list[int] | None = None,
        local_cpulist: str | None = None,
        driver: str | None = None,
        irq_names: list[str] | None = None,
    ) -> FakeHost:
        """A PCI function with its MSI/MSI-X IRQs (also listed in /proc/interrupts).

        `irqs` None allocates none; `irq_names` gives the action of each IRQ
        (default "<driver>"); the chip column names the bdf as on x86.
        """
        numbers = list(irqs or [])
        self._pci[bdf] = _Pci(vendor, device, class_, numa_node, local_cpulist, numbers, driver)
        names = irq_names or [driver or "pci"] * len(numbers)
        for n, name in zip(numbers, names, strict=True):
            self.interrupt(n, name, chip=f"IR-PCI-MSIX-{bdf}", hwirq=f"{n}-edge")
        return self

    def _alloc_irqs(self, count: int) -> list[int]:
        first = self._next_irq
        self._next_irq += count
        return list(range(first, first + count))

    def nvidia_gpu(
        self,
        bdf: str,
        numa_node: int | str,
        *,
        uuid: str | None = None,
        local_cpulist: str | None = None,
        model: str = "NVIDIA H100 80GB HBM3",
        proc_entry: bool = True,
        n_irqs: int = 1,
    ) -> FakeHost:
        """An NVIDIA GPU: PCI 10de class 0302, procfs information file, dev/nvidiaN."""
        seq = len(self._nvidia)
        uuid = uuid or f"GPU-{seq:08x}-1111-2222-3333-{zlib.crc32(bdf.encode()):012x}"
        self._nvidia[bdf] = _Nvidia(uuid, model, proc_entry)
        self.pci_device(
            bdf,
            0x10DE,
            0x2330,
            0x030200,
            numa_node,
            irqs=self._alloc_irqs(n_irqs),
            local_cpulist=local_cpulist,
            driver="nvidia",
            irq_names=["nvidia"] * n_irqs,
        )
        return self

    def amd_gpu(
        self,
        bdf: str,
        numa_node: int | str,
        *,
        class_: int = 0x120000,
        device: int = 0x74A1,
        driver: str | None = "amdgpu",
        n_irqs: int = 1,
    ) -> FakeHost:
        """An AMD GPU (default MI300X: 1002:74a1, processing accelerator) plus dev/kfd."""
        self.pci_device(
            bdf,
            0x1002,
            device,
            class_,
            numa_node,
            irqs=self._alloc_irqs(n_irqs),
            driver=driver,
            irq_names=[driver or "pci"] * n_irqs,
        )
        if driver == "amdgpu":
            self._dev.add("kfd")
        return self

    def ascend_npu(
        self,
        bdf: str | None,
        numa_node: int | str = -1,
        *,
        ubcore_numa: int | None = None,
        ub_totalues: int = 8,
        device: int = 0xD803,
        n_irqs: int = 2,
    ) -> FakeHost:
        """An Ascend NPU: PCI 19e5 class 1200 (unless bdf is None), dev/davinciN,
        and with `ubcore_numa` a sys/class/ubcore/udmaN entry (raw, unfolded node)."""
        index = sum(1 for d in self._dev if d.startswith("davinci") and d[7:].isdigit())
        self._dev.add(f"davinci{index}")
        self._dev.add("davinci_manager")
        if bdf is not None:
            self.pci_device(
                bdf,
                0x19E5,
                device,
                0x120000,
                numa_node,
                irqs=self._alloc_irqs(n_irqs),
                driver="devdrv_device_driver",
                irq_names=[f"devdrv-sq-cq{i}" for i in range(n_irqs)],
            )
        if ubcore_numa is not None:
            self._ubcore.append(_Ubcore(f"udma{len(self._ubcore)}", ub_totalues, ubcore_numa))
        return self

    def ubcore_entry(self, name: str, total_ues: int, numa: int) -> FakeHost:
        """An extra ubcore entry (e.g. one with ub_totalues 0, which is skipped)."""
        self._ubcore.append(_Ubcore(name, total_ues, numa))
        return self

    def dev_node(self, name: str) -> FakeHost:
        """An arbitrary /dev entry (e.g. nvidia0 on a host without procfs entries)."""
        self._dev.add(name)
        return self

    def nic(
        self,
        bdf: str,
        numa_node: int | str,
        *,
        ib: str | None = None,
        netdev: str | None = None,
        n_irqs: int = 4,
        vendor: int = 0x15B3,
        device: int = 0x1021,
    ) -> FakeHost:
        """A NIC function (default ConnectX-7) with an InfiniBand name and/or netdev.

        Its IRQs are named as mlx5 names them: "mlx5_compN@pci:<bdf>".
        """
        class_ = 0x020700 if ib and not netdev else 0x020000
        names = [f"mlx5_comp{i}@pci:{bdf}" for i in range(n_irqs)]
        self.pci_device(
            bdf,
            vendor,
            device,
            class_,
            numa_node,
            irqs=self._alloc_irqs(n_irqs),
            driver="mlx5_core",
            irq_names=names,
        )
        if ib:
            self._ib[ib] = bdf
        if netdev:
            self._net[netdev] = bdf
        return self

    def netdev(self, name: str, bdf: str) -> FakeHost:
        """A netdev whose device link points at an existing PCI function `bdf`."""
        self._net[name] = bdf
        return self

    def virtual_netdev(self, name: str) -> FakeHost:
        """A netdev without a device link (lo, bridges, veth)."""
        self._net[name] = None
        return self

    def interrupt(
        self, number: int, name: str, chip: str = "IO-APIC", hwirq: str = "0-edge"
    ) -> FakeHost:
        """One /proc/interrupts line (replaces an earlier one with the same number)."""
        self._irqs = [i for i in self._irqs if i.number != number]
        self._irqs.append(_Irq(number, chip, hwirq, name))
        return self

    # -- overrides ---------------------------------------------------------------

    def raw(self, rel: str, text: str) -> FakeHost:
        """Write `text` to `rel` after everything else (garble one file)."""
        self._raw[rel] = text
        return self

    def remove(self, rel: str) -> FakeHost:
        """Delete `rel` after building (drop one file)."""
        self._removed.add(rel)
        return self

    # -- writing -------------------------------------------------------------------

    def _write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def _link(self, rel: str, target: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            path.unlink()
        os.symlink(target, path)

    def build(self) -> Path:
        """Write the tree and return its root."""
        self.root.mkdir(parents=True, exist_ok=True)
        present = set(self._cpus)
        online = present - self._offline
        n_possible = (max(present) + 1 if present else 0) + self._possible_extra
        self._write_cpus(present, online, n_possible)
        node_ids = sorted(self._nodes)
        if self._numa_dirs:
            self._write_nodes(node_ids, online)
        self._write_status(online, node_ids)
        self._write_cgroup()
        self._write_pci(online)
        self._write_nvidia()
        for name in sorted(self._dev):
            self._write(f"dev/{name}", "")
        self._write("dev/null", "")
        for entry in self._ubcore:
            self._write(f"sys/class/ubcore/{entry.name}/device/ub_totalues", f"{entry.total_ues}\n")
            self._write(f"sys/class/ubcore/{entry.name}/device/numa", f"{entry.numa}\n")
        for ib, ib_bdf in sorted(self._ib.items()):
            self._link(f"sys/class/infiniband/{ib}/device", f"../../../{ib_bdf}")
            self._write(f"sys/class/infiniband/{ib}/node_type", "1: CA\n")
        for net, net_bdf in sorted(self._net.items()):
            self._write(f"sys/class/net/{net}/type", "1\n")
            if net_bdf is not None:
                self._link(f"sys/class/net/{net}/device", f"../../../{net_bdf}")
        self._write_interrupts(sorted(online))
        for rel, text in self._raw.items():
            self._write(rel, text)
        for rel in self._removed:
            (self.root / rel).unlink()
        return self.root

    def _write_cpus(self, present: set[int], online: set[int], n_possible: int) -> None:
        base = "sys/devices/system/cpu"
        self._write(f"{base}/online", format_cpulist(online) + "\n")
        self._write(f"{base}/present", format_cpulist(present) + "\n")
        self._write(f"{base}/possible", format_cpulist(range(n_possible)) + "\n")
        for cpu in sorted(present):
            spec = self._cpus[cpu]
            d = f"{base}/cpu{cpu}"
            if cpu != 0:
                self._write(f"{d}/online", "0\n" if cpu in self._offline else "1\n")
            if cpu in self._offline:
                continue  # the kernel removes topology/ of an offline CPU
            siblings = format_cpulist(self._threads[cpu] & online) + "\n"
            package_cpus = {c for c, s in self._cpus.items() if s.package == spec.package}
            self._write(f"{d}/topology/core_id", f"{spec.core}\n")
            self._write(f"{d}/topology/physical_package_id", f"{spec.package}\n")
            self._write(f"{d}/topology/thread_siblings_list", siblings)
            if self._old_topology:
                continue
            self._write(f"{d}/topology/die_id", f"{spec.die}\n")
            self._write(f"{d}/topology/cluster_id", f"{spec.cluster}\n")
            self._write(f"{d}/topology/core_cpus_list", siblings)
            self._write(
                f"{d}/topology/package_cpus_list", format_cpulist(package_cpus & online) + "\n"
            )
            if self._l3_cores:  # cache/index3: the L3 of `_l3_cores` cores in a row
                l3 = {
                    c
                    for c, s in self._cpus.items()
                    if s.package == spec.package
                    and s.core // self._l3_cores == spec.core // self._l3_cores
                }
                self._write(f"{d}/cache/index3/level", "3\n")
                self._write(f"{d}/cache/index3/shared_cpu_list", format_cpulist(l3) + "\n")

    def _default_distance(self, a: int, b: int) -> int:
        if a == b:
            return 10
        pa = {self._cpus[c].package for c in self._nodes[a].cpus}
        pb = {self._cpus[c].package for c in self._nodes[b].cpus}
        return 12 if pa and pa == pb else 32

    def _write_nodes(self, node_ids: list[int], online: set[int]) -> None:
        base = "sys/devices/system/node"
        self._write(f"{base}/online", format_cpulist(node_ids) + "\n")
        self._write(f"{base}/possible", format_cpulist(node_ids) + "\n")
        has_cpu = [n for n in node_ids if self._nodes[n].cpus & online]
        has_mem = [n for n in node_ids if self._nodes[n].mem_bytes > 0]
        self._write(f"{base}/has_cpu", format_cpulist(has_cpu) + "\n")
        self._write(f"{base}/has_memory", format_cpulist(has_mem) + "\n")
        for i, n in enumerate(node_ids):
            spec = self._nodes[n]
            d = f"{base}/node{n}"
            self._write(f"{d}/cpulist", format_cpulist(spec.cpus & online) + "\n")
            self._write(f"{d}/cpumap", format_mask(spec.cpus & online) + "\n")
            if self._distances is not None:
                row = self._distances[i]
            else:
                row = [self._default_distance(n, m) for m in node_ids]
            self._write(f"{d}/distance", " ".join(str(x) for x in row) + "\n")
            kb = spec.mem_bytes // 1024
            used = kb // 8
            self._write(
                f"{d}/meminfo",
                f"Node {n} MemTotal:       {kb:>10} kB\n"
                f"Node {n} MemFree:        {kb - used:>10} kB\n"
                f"Node {n} MemUsed:        {used:>10} kB\n",
            )

    def _write_status(self, online: set[int], node_ids: list[int]) -> None:
        cpus = self._allowed_cpus if self._allowed_cpus is not None else format_cpulist(online)
        mem_nodes = [n for n in node_ids if self._nodes[n].mem_bytes > 0] or [0]
        mems = self._allowed_mems if self._allowed_mems is not None else format_cpulist(mem_nodes)
        self._write(
            "proc/self/status",
            "Name:\tpython3\nUmask:\t0022\nState:\tR (running)\nTgid:\t4242\nPid:\t4242\n"
            f"Cpus_allowed:\t{format_mask(parse_cpulist(cpus))}\n"
            f"Cpus_allowed_list:\t{cpus}\n"
            f"Mems_allowed:\t{format_mask(parse_cpulist(mems))}\n"
            f"Mems_allowed_list:\t{mems}\n"
            "voluntary_ctxt_switches:\t1\nnonvoluntary_ctxt_switches:\t0\n",
        )

    def _write_cgroup(self) -> None:
        cg = self._cgroup
        if cg is None:
            # A plain cgroup2 host with the process in the root cgroup and no
            # cpuset controller enabled below it.
            self._write("proc/self/cgroup", "0::/\n")
            self._write("sys/fs/cgroup/cgroup.controllers", "cpu io memory pids\n")
            return
        rel = cg.path.strip("/")
        if cg.version == 2:
            self._write("proc/self/cgroup", f"0::{cg.path}\n")
            base = "sys/fs/cgroup"
            self._write(f"{base}/cgroup.controllers", "cpuset cpu io memory pids\n")
            d = f"{base}/{rel}" if rel else base
            self._write(f"{d}/cpuset.cpus.effective", cg.cpus + "\n")
            self._write(f"{d}/cpuset.mems.effective", cg.mems + "\n")
            self._write(f"{d}/cpuset.cpus", cg.cpus + "\n")
            self._write(f"{d}/cgroup.procs", "4242\n")
            return
        lines = [
            "12:memory:" + cg.path,
            "4:cpu,cpuacct:" + cg.path,
            "3:cpuset:" + cg.path,
            "1:name=systemd:" + cg.path,
        ]
        if cg.hybrid:
            lines.append("0::/")
            self._write("sys/fs/cgroup/unified/cgroup.controllers", "")
        self._write("proc/self/cgroup", "\n".join(lines) + "\n")
        d = f"sys/fs/cgroup/cpuset/{rel}" if rel else "sys/fs/cgroup/cpuset"
        self._write(f"{d}/cpuset.cpus", cg.cpus + "\n")
        self._write(f"{d}/cpuset.mems", cg.mems + "\n")
        self._write(f"{d}/cpuset.effective_cpus", cg.cpus + "\n")
        self._write(f"{d}/cpuset.effective_mems", cg.mems + "\n")
        self._write(f"{d}/tasks", "4242\n")

    def _write_pci(self, online: set[int]) -> None:
        for bdf, spec in sorted(self._pci.items()):
            d = f"sys/bus/pci/devices/{bdf}"
            self._write(f"{d}/vendor", f"0x{spec.vendor:04x}\n")
            self._write(f"{d}/device", f"0x{spec.device:04x}\n")
            self._write(f"{d}/class", f"0x{spec.class_:06x}\n")
            self._write(f"{d}/numa_node", f"{spec.numa_node}\n")
            local = spec.local_cpulist
            if local is None:
                node = self._nodes.get(spec.numa_node) if isinstance(spec.numa_node, int) else None
                cpus = node.cpus & online if node is not None and node.cpus else online
                local = format_cpulist(cpus)
            self._write(f"{d}/local_cpulist", local + "\n")
            (self.root / d / "msi_irqs").mkdir(parents=True, exist_ok=True)
            for n in spec.irqs:
                self._write(f"{d}/msi_irqs/{n}", "msix\n")
            if spec.driver:
                self._link(f"{d}/driver", f"../../../../bus/pci/drivers/{spec.driver}")

    def _write_nvidia(self) -> None:
        for minor, (bdf, spec) in enumerate(sorted(self._nvidia.items())):
            self._write(f"dev/nvidia{minor}", "")
            if not spec.proc_entry:
                continue
            irq = self._pci[bdf].irqs[0] if self._pci[bdf].irqs else 0
            self._write(
                f"proc/driver/nvidia/gpus/{bdf}/information",
                f"Model: \t\t {spec.model}\n"
                f"IRQ:   \t\t {irq}\n"
                f"GPU UUID: \t {spec.uuid}\n"
                "Video BIOS: \t 96.00.99.00.01\n"
                "Bus Type: \t PCIe\n"
                "DMA Size: \t 52 bits\n"
                "DMA Mask: \t 0xfffffffffffff\n"
                f"Bus Location: \t {bdf}\n"
                f"Device Minor: \t {minor}\n"
                "GPU Excluded:\t No\n",
            )
        if self._nvidia:
            self._write("dev/nvidiactl", "")

    def _write_interrupts(self, online: list[int]) -> None:
        header = " " * 11 + "".join(f"CPU{c:<7}" for c in online).rstrip()
        lines = [header]
        for irq in sorted(self._irqs, key=lambda i: i.number):
            counts = "".join(f"{(irq.number * 7 + c) % 1000:>11}" for c in online)
            lines.append(f"{irq.number:>4}:{counts} {irq.chip:>8} {irq.hwirq:<8}  {irq.name}")
        lines.append("NMI:" + "".join(f"{0:>11}" for _ in online) + "   Non-maskable interrupts")
        lines.append("ERR:          0")
        self._write("proc/interrupts", "\n".join(lines) + "\n")
