"""The discovery entry point: host files -> `Topology` (all reads via one HostFS).

Order: CPU masks, nodes, per-CPU topology, allowed set, PCI scan,
accelerators (or stand-ins), visibility, NICs, IRQs. Garbled or missing
essential files raise one TopologyError naming the file and value.
"""

from __future__ import annotations

import shlex
from collections import defaultdict
from dataclasses import replace

from supervisor.errors import TopologyError
from supervisor.hostfs import HostFS
from supervisor.topology.accelerators import AUTO, BY_NAME, CPU, DISCOVERED, PCI
from supervisor.topology.cgroup import read_allowed
from supervisor.topology.cpus import read_cpu_masks, read_cpus
from supervisor.topology.devices import cpu_standins, read_config_pci, read_kind
from supervisor.topology.interrupts import assign_irqs, read_interrupts
from supervisor.topology.kernel import read_numa_balancing
from supervisor.topology.model import Device, DiscoveryOptions, Node, Topology, device_order
from supervisor.topology.nics import read_nics
from supervisor.topology.numa import node_of_cpus, read_nodes
from supervisor.topology.pci import PciId, scan_pci
from supervisor.topology.visibility import apply_visibility


class NoDevicesError(TopologyError):
    """`accelerator = KIND` but the host has no KIND devices (exit 3).

    The message names the way forward: the shipped example host with such
    devices (`plan --example`). Discovery does not know the config's path or
    whether the root is an example; the command line adds both (`located`).
    """

    def __init__(
        self, kind: str, root: str, config_path: str | None = None, example: str | None = None
    ) -> None:
        self.kind = kind
        self.root = root
        where = f"in example {example}" if example else f"under {root}"
        message = f"accelerator = {kind!r} but no {kind} devices were found {where}"
        suggestion = BY_NAME[kind].example if kind in BY_NAME else None
        if suggestion is not None and suggestion != example:
            if example:
                lead = "this config plans on"
            else:
                lead = "to see this config's plan on a host without them"
            config = shlex.quote(config_path) if config_path else "FILE"
            message += (
                f"; {lead}: placement-supervisor plan --config {config} --example {suggestion}"
                " (all examples: placement-supervisor topology --example list)"
            )
        super().__init__(message)

    def located(self, config_path: str | None, example: str | None) -> NoDevicesError:
        """The same error naming the config file and the example it was read from."""
        return NoDevicesError(self.kind, self.root, config_path, example)


def _read_devices(
    fs: HostFS, options: DiscoveryOptions, nodes: tuple[Node, ...], allowed_cpus: frozenset[int]
) -> tuple[tuple[Device, ...], tuple[str, ...]]:
    wanted = options.accelerator
    devices: list[Device] = []
    warnings: list[str] = []
    scan: tuple[PciId, ...] | None = None  # read once, and only when a wanted kind needs it
    for kind in DISCOVERED:
        if wanted not in (AUTO, kind.name):
            continue
        if kind.pci is not None and scan is None:
            scan = scan_pci(fs)
        found, warn = read_kind(fs, kind, scan or (), nodes, options.logical_ids)
        devices += found
        warnings += warn
    if wanted in (AUTO, PCI.name):
        if wanted == PCI.name and not options.pci_devices:
            raise TopologyError(f"accelerator = {PCI.name!r} but the config names no PCI devices")
        found, warn = read_config_pci(fs, options.pci_devices, nodes)
        devices += found
        warnings += warn
    if wanted not in (AUTO, CPU.name) and not devices:
        raise NoDevicesError(wanted, fs.root)
    if options.scope is not None and options.scope.devices is not None:
        devices, reach_warnings = within_reach(devices, options.scope.devices)
        warnings += reach_warnings
    if not devices:
        devices += cpu_standins(nodes, allowed_cpus, options.cpu_ranks)
    devices.sort(key=device_order)
    return tuple(devices), tuple(warnings)


def within_reach(devices: list[Device], reach: tuple[str, ...]) -> tuple[list[Device], list[str]]:
    """The devices whose PCI address is in `reach` (`engine.attach.devices`), with
    warnings (pure). The others are not hidden but gone from this plan: a
    container's devices are its whole world, and its cpuset is its own, so no CPUs
    are kept for the host's others (a hidden device's are: another service on the
    same host may run there). Devices found by their nodes alone have no address
    to tell them by: then all are kept, with a warning."""
    if not devices:
        return devices, []
    unknown = [d.label for d in devices if d.bdf is None]
    if unknown:
        return devices, [
            f"engine.attach.devices: {', '.join(unknown)} have no PCI address (found by "
            "their device nodes only), so the engine's cannot be told apart: planning all"
        ]
    wanted = set(reach)
    kept = [d for d in devices if d.bdf in wanted]
    found = {d.bdf for d in devices}
    warnings = [
        f"engine.attach.devices: {bdf} is none of this host's accelerators: left out"
        for bdf in reach
        if bdf not in found
    ]
    if not kept:
        warnings.append(
            "engine.attach.devices: the engine reaches none of this host's "
            f"{len(devices)} accelerators: planning it as CPU-only"
        )
    return kept, warnings


def read_topology(fs: HostFS, options: DiscoveryOptions = DiscoveryOptions()) -> Topology:  # noqa: B008
    """Discover the host under `fs.root`."""
    masks = read_cpu_masks(fs)
    nodes = read_nodes(fs, masks.online)
    cpus = read_cpus(fs, masks.online, node_of_cpus(nodes))
    allowed = read_allowed(fs, masks.online, frozenset(n.id for n in nodes), options.scope)
    devices, warnings = _read_devices(fs, options, nodes, allowed.cpus)
    devices = apply_visibility(devices, dict(options.env))
    nics = read_nics(fs, nodes)

    # msi_irqs/ is authoritative: the chip column of /proc/interrupts names
    # the PCI function on some kernels only ("PCI-MSI 49152-edge" on others).
    msi_owner = {irq: n.bdf for n in nics if n.bdf for irq in n.irqs}
    msi_owner.update({irq: d.bdf for d in devices if d.bdf for irq in d.irqs})
    names = {n.name: n.bdf for n in nics if n.bdf}
    irqs = assign_irqs(read_interrupts(fs), msi_owner, names)
    by_bdf: dict[str, set[int]] = defaultdict(set)
    for irq in irqs:
        if irq.bdf:
            by_bdf[irq.bdf].add(irq.number)
    devices = tuple(
        d if d.bdf is None else replace(d, irqs=tuple(sorted(by_bdf[d.bdf] | set(d.irqs))))
        for d in devices
    )
    nics = tuple(
        n if n.bdf is None else replace(n, irqs=tuple(sorted(by_bdf[n.bdf] | set(n.irqs))))
        for n in nics
    )
    return Topology(
        cpus=cpus,
        present=masks.present,
        possible=masks.possible,
        nodes=nodes,
        allowed=allowed,
        devices=devices,
        nics=nics,
        irqs=irqs,
        warnings=warnings,
        numa_balancing=read_numa_balancing(fs),
    )


def reread_cpus(fs: HostFS, old: Topology) -> Topology:
    """`old` with its CPUs, nodes and allowed set read again: what a cpuset write
    or a CPU hotplug can change. Devices, NICs and IRQs are kept: the daemon's
    ranks are fixed for its lifetime, and PCI or /proc/interrupts need no re-read."""
    masks = read_cpu_masks(fs)
    nodes = read_nodes(fs, masks.online)
    cpus = read_cpus(fs, masks.online, node_of_cpus(nodes))
    allowed = read_allowed(fs, masks.online, frozenset(n.id for n in nodes), old.allowed.scope)
    return replace(
        old,
        cpus=cpus,
        present=masks.present,
        possible=masks.possible,
        nodes=nodes,
        allowed=allowed,
    )
