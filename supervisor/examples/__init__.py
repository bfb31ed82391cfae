"""Named example hosts that ship with the package (`plan --example NAME`). No I/O here.

builder.FakeHost writes a host tree of real Linux-format files under a
directory; hosts.py holds the machine shapes; catalogue.py names them for the
command line. `EXAMPLE_FOR_KIND` is the example a config of each accelerator
kind plans on (named in discovery's "no devices were found" error).
"""

from __future__ import annotations

from supervisor.topology.accelerators import KINDS

EXAMPLE_FOR_KIND: dict[str, str] = {k.name: k.example for k in KINDS if k.example is not None}
