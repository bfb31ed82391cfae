"""A kind's runtime numbering (logical ids) of its devices (`parse_*` pure, `read_*` via HostFS).

Some runtimes do not number devices in PCI bus order: Ascend's counts NPUs by
logical id, and ASCEND_RT_VISIBLE_DEVICES indexes those. Sources, most
authoritative first: the config's `logical_ids` (the operator's word: PCI
addresses in logical id order), the vendor tool's own output captured to
files (the kind's `LogicalIds` record), else PCI bus order with a warning.
Discovery never runs the tool (no subprocess, no accelerator library); the
captured files are host files like any other, so `snapshot` carries them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from supervisor.errors import TopologyError
from supervisor.hostfs import HostFS
from supervisor.topology.accelerators import AcceleratorKind, LogicalIds
from supervisor.topology.model import Device
from supervisor.topology.pci import normalize_bdf


def normal_bdf(text: str) -> str | None:
    """ "0000:C1:00.0", "00000000:C1:00.0" or "C1:00.0" as sysfs names it: "0000:c1:00.0"."""
    text = text.strip()
    return normalize_bdf(text) or normalize_bdf(f"0000:{text}")


def parse_device_table(text: str) -> dict[tuple[int, int], str]:
    """(device id, chip id) -> bus id from the tool's device table.

    Each device is a block of rows: `| <id> <name> | <health> | ...` and then
    one `| <chip> | <bus id> | ...` row per chip. Process rows (`| <id>
    <chip> | <pid> | ...`) have no bus id and are skipped.
    """
    out: dict[tuple[int, int], str] = {}
    device: int | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        words = cells[0].split()
        second = cells[1].split()
        if len(words) >= 2 and words[0].isdigit():
            # A device row ("| 0  910B3 | OK |"), not a process row ("| 0  0 | 4242 |").
            if not (second and second[0].isdigit()):
                device = int(words[0])
        elif len(words) == 1 and words[0].isdigit() and device is not None:
            bdf = normal_bdf(cells[1].split()[0]) if cells[1] else None
            if bdf is not None:
                out[(device, int(words[0]))] = bdf
    return out


def parse_logical_map(text: str) -> dict[tuple[int, int], int | None]:
    """(device id, chip id) -> logical id ("-": None, e.g. the MCU) of the mapping table."""
    out: dict[tuple[int, int], int | None] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 3 and words[0].isdigit() and words[1].isdigit():
            out[(int(words[0]), int(words[1]))] = int(words[2]) if words[2].isdigit() else None
    return out


def logical_by_bdf(
    table: Mapping[tuple[int, int], str], mapping: Mapping[tuple[int, int], int | None]
) -> dict[str, int]:
    """bus id -> logical id. Where the mapping reports no logical id at all
    (Ascend 950 leaves "Chip Logic ID" out), the device id stands in for it."""
    if not mapping:  # an empty or failed capture says nothing
        return {}
    if any(v is not None for v in mapping.values()):
        return {bdf: lid for key, bdf in table.items() if (lid := mapping.get(key)) is not None}
    first_chip: dict[int, tuple[int, str]] = {}
    for (device, chip), bdf in table.items():
        if device not in first_chip or chip < first_chip[device][0]:
            first_chip[device] = (chip, bdf)
    return {bdf: device for device, (_, bdf) in first_chip.items()}


@dataclass(frozen=True, slots=True)
class Numbering:
    """bus id -> logical id, and where it came from (for the plan and `topology`)."""

    ids: Mapping[str, int]
    source: str


def read_captured(fs: HostFS, record: LogicalIds) -> Numbering | None:
    """The numbering of the captured tool output, or None where the files are not there."""
    table_text = fs.read_optional(f"{record.captured_dir}/{record.table}")
    mapping_text = fs.read_optional(f"{record.captured_dir}/{record.mapping}")
    if table_text is None or mapping_text is None:
        return None
    ids = logical_by_bdf(parse_device_table(table_text), parse_logical_map(mapping_text))
    return Numbering(ids, f"{record.captured_dir}/{{{record.table},{record.mapping}}}")


def numbered(
    devices: Sequence[tuple[Device, str | None]],
    kind: AcceleratorKind,
    numbering: Numbering | None,
) -> tuple[list[tuple[Device, str | None]], tuple[str, ...], str]:
    """`devices` (PCI bus order) with index = logical id, sorted by it; warnings; the source.

    A numbering that does not give every device one distinct id of 0..n-1
    is not used (a warning says why) and PCI bus order stays.
    """
    if not devices:
        return list(devices), (), "PCI bus order"
    record = kind.logical_ids
    if numbering is None:
        how = f" (capture `{record.tool}` into {record.captured_dir}/, " if record else " ("
        return (
            list(devices),
            (
                f"{kind.name}: logical ids unknown, assuming PCI bus order{how}"
                "or set logical_ids in the config)",
            ),
            "PCI bus order",
        )
    ids = [numbering.ids.get(d.bdf or "") for d, _ in devices]
    problem = None
    if None in ids:
        missing = [d.bdf or d.label for (d, _), i in zip(devices, ids, strict=True) if i is None]
        problem = f"no logical id for {', '.join(missing)}"
    elif sorted(i for i in ids if i is not None) != list(range(len(devices))):
        problem = (
            f"logical ids {sorted(i for i in ids if i is not None)} are not 0..{len(devices) - 1}"
        )
    if problem is not None:
        if numbering.source.startswith("config"):
            raise TopologyError(f"{numbering.source}: {problem}")
        return (
            list(devices),
            (f"{kind.name}: {numbering.source}: {problem}; assuming PCI bus order",),
            "PCI bus order",
        )
    out = [
        (replace(d, index=i), w) for (d, w), i in zip(devices, ids, strict=True) if i is not None
    ]
    out.sort(key=lambda pair: pair[0].index)
    return out, (), numbering.source


def read_numbering(
    fs: HostFS, kind: AcceleratorKind, override: tuple[str, ...]
) -> Numbering | None:
    """The config's `logical_ids` where given, else the captured files, else None."""
    if override:
        return Numbering(
            {normal_bdf(b) or b: i for i, b in enumerate(override)}, "config logical_ids"
        )
    return None if kind.logical_ids is None else read_captured(fs, kind.logical_ids)
