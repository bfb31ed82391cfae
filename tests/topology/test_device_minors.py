"""Device numbers to accelerators on fixture trees (NVIDIA's `Device Minor`, the
kernel's /sys/dev/char links for AMD render nodes and Ascend davinci nodes), and
the device rule ranking by the number a process holds, not its node's name.

A real process holds a real character device open (a node made with /dev/null's
numbers under tmp): its /proc/<pid>/fd link names the path, stat(2) of that link
gives the number the table is keyed by.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from supervisor.engines.naming import device_rank
from supervisor.engines.rank_source import ProcFacts
from supervisor.hostfs import HostFS
from supervisor.topology.device_minors import (
    NVIDIA_MAJOR,
    bdf_of_link,
    device_rank_by_number,
    parse_device_minor,
    read_char_devices,
)
from tests.support.poll import poll

INFO = (
    "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 182\nGPU UUID: \t GPU-1\n"
    "Device Minor: \t {}\nBus Location: \t {}\n"
)


def test_parse_device_minor_and_sysfs_links() -> None:
    assert parse_device_minor(INFO.format(3, "0000:1b:00.0")) == 3
    assert parse_device_minor("Model: x\n") is None
    link = "../../devices/pci0000:00/0000:00:01.1/0000:03:00.0/drm/renderD129"
    assert bdf_of_link(link) == "0000:03:00.0"
    assert bdf_of_link("../../devices/virtual/mem/null") is None


def test_read_char_devices_on_a_fixture_tree(tmp_path: Path) -> None:
    # NVIDIA: the minor is not the order of the bus ids (a container's view).
    for bdf, minor in (("0000:1b:00.0", 3), ("0000:9a:00.0", 0)):
        d = tmp_path / "proc/driver/nvidia/gpus" / bdf
        d.mkdir(parents=True)
        (d / "information").write_text(INFO.format(minor, bdf))
    # AMD render node and an Ascend davinci node, as the kernel links them.
    chars = tmp_path / "sys/dev/char"
    chars.mkdir(parents=True)
    (chars / "226:129").symlink_to(
        "../../devices/pci0000:00/0000:00:01.1/0000:03:00.0/drm/renderD129"
    )
    (chars / "236:2").symlink_to("../../devices/pci0000:80/0000:80:00.0/0000:81:00.0/davinci2")
    (chars / "1:3").symlink_to("../../devices/virtual/mem/null")
    got = read_char_devices(HostFS(str(tmp_path)))
    assert got == {
        (NVIDIA_MAJOR, 3): "0000:1b:00.0",
        (NVIDIA_MAJOR, 0): "0000:9a:00.0",
        (226, 129): "0000:03:00.0",
        (236, 2): "0000:81:00.0",
    }
    ranks = device_rank_by_number(got, {"0000:1b:00.0": 0, "0000:9a:00.0": 1})
    assert ranks == {(NVIDIA_MAJOR, 3): 0, (NVIDIA_MAJOR, 0): 1}
    # A process holding /dev/nvidia0 whose number is 195:3 drives rank 0's GPU,
    # though its node name says device 0 (rank 1 by name).
    facts = ProcFacts({}, "ray::Actor", ("/dev/nvidia0",), ((NVIDIA_MAJOR, 3),))
    assert device_rank(facts, {0: 1, 1: 0}, ranks) == 0
    assert device_rank(facts, {0: 1, 1: 0}, {}) == 1  # without the driver's table: by name


def test_the_number_a_real_process_holds_open(tmp_path: Path) -> None:
    node = tmp_path / "nvidia5"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers: openable
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time; fd = os.open({str(node)!r}, os.O_RDWR); time.sleep(60)",
        ]
    )
    try:
        fs = HostFS("/")

        def held_fd() -> str | None:
            for name in fs.listdir(f"proc/{holder.pid}/fd"):
                if fs.readlink(f"proc/{holder.pid}/fd/{name}") == str(node):
                    return f"proc/{holder.pid}/fd/{name}"
            return None

        link = poll(held_fd, timeout_s=20, what="the node held open")
        # The name says 5; the number (what read_proc_facts records) is 1:3.
        assert fs.char_device(link) == (1, 3)
        assert fs.char_device(f"proc/{holder.pid}/cmdline") is None  # not a device
    finally:
        holder.kill()
        holder.wait()
