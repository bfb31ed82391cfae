"""/proc/interrupts parsing (pure) on x86 and ARM formats, and text rendering."""

from __future__ import annotations

from pathlib import Path

from supervisor.examples import hosts
from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology
from supervisor.topology.interrupts import assign_irqs, parse_interrupts
from supervisor.topology.render import render_topology_text

X86 = """\
           CPU0       CPU1
  26:          0         14  IO-APIC   4-edge      ttyS0
  41:       1864          0 PCI-MSIX-0000:00:04.0   1-edge      virtio3-rx
 120:          5          7  IR-PCI-MSIX-0000:18:00.1 1572864-edge      mlx5_comp3@pci:0000:18:00.1
 130:          0          0  IR-IO-APIC   16-fasteoi   ehci_hcd:usb1, i801_smbus
NMI:          0          0   Non-maskable interrupts
ERR:          0
"""

ARM = """\
           CPU0       CPU1       CPU2
 11:      12345      23456      34567     GICv3  27 Level     arch_timer
 90:          1          0          0   ITS-MSI 524288 Edge      eth0-TxRx-0
IPI0:       100        200        300       Rescheduling interrupts
"""


def test_parse_x86() -> None:
    lines = {line.number: line for line in parse_interrupts(X86)}
    assert sorted(lines) == [26, 41, 120, 130]
    assert lines[41].name == "virtio3-rx" and "0000:00:04.0" in lines[41].chip
    assert lines[120].name == "mlx5_comp3@pci:0000:18:00.1"
    assert lines[130].name == "ehci_hcd:usb1, i801_smbus"
    irqs = {i.number: i.bdf for i in assign_irqs(parse_interrupts(X86), {}, {})}
    assert irqs == {26: None, 41: "0000:00:04.0", 120: "0000:18:00.1", 130: None}


def test_parse_arm_and_owner_by_netdev_name() -> None:
    lines = parse_interrupts(ARM)
    assert [(x.number, x.name) for x in lines] == [(11, "arch_timer"), (90, "eth0-TxRx-0")]
    irqs = assign_irqs(lines, {200: "0000:01:00.0"}, {"eth0": "0000:3b:00.0", "eth": "x"})
    assert [(i.number, i.bdf) for i in irqs] == [
        (11, None),
        (90, "0000:3b:00.0"),
        (200, "0000:01:00.0"),
    ]


def test_render_text_reads_like_numactl_and_topo(tmp_path: Path) -> None:
    text = render_topology_text(read_topology(HostFS(str(hosts.dgx_a100_nps4(tmp_path)))))
    assert "available: 8 nodes (0-7)" in text
    assert "node 3 cpus: 48-63,176-191" in text
    assert "node 3 size: 131072 MB" in text
    row = next(line for line in text.splitlines() if line.startswith("nvidia0 "))
    assert row.split()[:4] == ["nvidia0", "0000:07:00.0", "3", "numa_node"]
    assert "48-63,176-191" in row
