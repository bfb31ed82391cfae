"""Which accelerator a character device number is: (major, minor) -> PCI address (reads /sys).

A device node's name and minor are not its index everywhere: a container
may bind the host's /dev/nvidia3 as /dev/nvidia0. The number a process holds
open (stat(2) of /proc/<pid>/fd/N) is the truth; the driver says which GPU
it is. NVIDIA: `Device Minor` in /proc/driver/nvidia/gpus/<bdf>/information,
major 195 (Documentation/admin-guide/devices.txt). AMD render nodes and
Ascend's davinci nodes: /sys/dev/char/<major>:<minor>, the kernel's link to
the device (Documentation/ABI/stable/sysfs-dev), under its PCI function.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from supervisor.hostfs import HostFS
from supervisor.topology.accelerators import NVIDIA

# The registry's record says both (supervisor.topology.accelerators).
NVIDIA_MAJOR: int = -1 if NVIDIA.char_major is None else NVIDIA.char_major
NVIDIA_GPUS: str = NVIDIA.driver_dir or ""
SYS_DEV_CHAR = "sys/dev/char"
_BDF = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def parse_device_minor(information: str) -> int | None:
    """ "Device Minor: \\t 3" of an NVIDIA information file, or None."""
    for line in information.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "Device Minor" and value.strip().isdigit():
            return int(value.strip())
    return None


def bdf_of_link(target: str) -> str | None:
    """The last PCI address in a sysfs device path
    ("../../devices/pci0000:00/0000:00:01.0/0000:03:00.0/drm/renderD128": 0000:03:00.0)."""
    found = None
    for part in target.lower().split("/"):
        if _BDF.match(part):
            found = part
    return found


def read_char_devices(fs: HostFS) -> dict[tuple[int, int], str]:
    """{(major, minor): bdf} of the host's accelerator device numbers (see the module doc)."""
    out: dict[tuple[int, int], str] = {}
    for entry in fs.listdir(NVIDIA_GPUS):
        minor = parse_device_minor(fs.read_optional(f"{NVIDIA_GPUS}/{entry}/information") or "")
        if minor is not None:
            out[(NVIDIA_MAJOR, minor)] = entry.lower()
    for name in fs.listdir(SYS_DEV_CHAR):
        major_text, sep, minor_text = name.partition(":")
        if not (sep and major_text.isdigit() and minor_text.isdigit()):
            continue
        if int(major_text) == NVIDIA_MAJOR:
            continue
        target = fs.readlink(f"{SYS_DEV_CHAR}/{name}")
        found = bdf_of_link(target) if target is not None else None
        if found is not None:
            out[(int(major_text), int(minor_text))] = found
    return out


def device_rank_by_number(
    numbers: Mapping[tuple[int, int], str], bdf_ranks: Mapping[str, int]
) -> dict[tuple[int, int], int]:
    """{(major, minor): rank} through each device's PCI address (pure)."""
    return {num: bdf_ranks[bdf] for num, bdf in numbers.items() if bdf in bdf_ranks}
