"""Named example hosts that ship with the package (`plan --example NAME`). No I/O here.

builder.FakeHost writes a host tree of real Linux-format files under a
directory; hosts.py holds the machine shapes; catalogue.py names them for the
command line. `EXAMPLE_FOR_KIND` is the example a config of each accelerator
kind plans on (named in discovery's "no devices were found" error).
"""

from __future__ import annotations

EXAMPLE_FOR_KIND: dict[str, str] = {
    "nvidia": "dgx-h100",
    "amd": "mi300x",
    "ascend": "ascend-16npu",
}
