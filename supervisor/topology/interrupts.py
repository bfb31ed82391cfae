"""/proc/interrupts parsing and IRQ ownership (pure parser; one read through HostFS).

Format (kernel/irq/proc.c show_interrupts): a header of CPU columns, then per
IRQ "NNN:" + one count per online CPU + chip name + hwirq/trigger + "  " +
the action names (comma-separated when shared). Named lines (NMI, LOC, ERR)
are not IRQ numbers and are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from supervisor.errors import TopologyError
from supervisor.hostfs import HostFS
from supervisor.topology.model import Irq
from supervisor.topology.pci import find_bdf

INTERRUPTS = "proc/interrupts"

_GAP = re.compile(r"\s{2,}")


@dataclass(frozen=True, slots=True)
class IrqLine:
    number: int
    chip: str  # everything between the counts and the actions ("IR-PCI-MSIX-0000:18:00.0 0-edge")
    name: str  # the actions column


def parse_interrupts(text: str, rel: str = INTERRUPTS) -> tuple[IrqLine, ...]:
    lines = text.splitlines()
    if not lines:
        return ()
    n_cpus = len(lines[0].split())
    # One count column per online CPU, skipped by one regex match (C speed: a
    # 224-CPU host has 224 columns on each of hundreds of lines); what follows
    # keeps its spacing, which separates the chip columns from the actions.
    counts = re.compile(rf"(?:\s*\d+){{{n_cpus}}}(?=\s|$)")
    result: list[IrqLine] = []
    for raw in lines[1:]:
        key, sep, rest = raw.partition(":")
        key = key.strip()
        if not sep or not key.isdigit():
            continue
        match = counts.match(rest)
        if match is None:
            raise TopologyError(f"garbled line in {rel}: {raw.strip()!r}", rel)
        remainder = rest[match.end() :].strip()
        if not remainder:
            result.append(IrqLine(int(key), "", ""))
            continue
        parts = _GAP.split(remainder)
        if len(parts) >= 2:
            chip, name = " ".join(parts[:-1]), parts[-1]
        else:
            chip, name = remainder, ""
        result.append(IrqLine(int(key), chip, name.strip()))
    return tuple(result)


def _owner_by_name(name: str, devices_by_name: Mapping[str, str]) -> str | None:
    """The bdf of a netdev/ib device whose name the action starts with ("eth0-TxRx-3")."""
    for dev_name in sorted(devices_by_name, key=len, reverse=True):
        if name == dev_name or re.match(rf"^(?:\w+-)?{re.escape(dev_name)}[-@_:]", name):
            return devices_by_name[dev_name]
    return None


def assign_irqs(
    lines: tuple[IrqLine, ...],
    msi_owner: Mapping[int, str],
    devices_by_name: Mapping[str, str],
) -> tuple[Irq, ...]:
    """Irq entries with their owning bdf: msi_irqs first (authoritative), then a
    bdf in the action or chip column, then a netdev/ib name in the action."""
    seen: dict[int, Irq] = {}
    for line in lines:
        bdf = (
            msi_owner.get(line.number)
            or find_bdf(line.name)
            or find_bdf(line.chip)
            or _owner_by_name(line.name, devices_by_name)
        )
        seen[line.number] = Irq(number=line.number, name=line.name, bdf=bdf)
    for number, bdf in msi_owner.items():
        seen.setdefault(number, Irq(number=number, name="", bdf=bdf))
    return tuple(seen[n] for n in sorted(seen))


def read_interrupts(fs: HostFS) -> tuple[IrqLine, ...]:
    text = fs.read_optional(INTERRUPTS)
    return () if text is None else parse_interrupts(text)
