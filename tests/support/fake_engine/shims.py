"""Run the stand-in engines under the engines' own module names (tests only; writes files).

`write_shim` makes `python -m vllm.entrypoints.openai.api_server` (or any
module path) run a function of tests/support/fake_engine/layouts.py, so that
the command line is the one operators run and the engine kind is recognised
from it. `records` reads which process drives which device from the
stand-ins' `--record-dir`.
"""

from __future__ import annotations

from pathlib import Path

SHIM = """import sys
from tests.support.fake_engine.layouts import {main}
if __name__ == "__main__":
    {main}(sys.argv[1:])
"""

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SGLANG_MODULE = "sglang.launch_server"


def write_shim(root: Path, module: str, main: str) -> None:
    """`root`/<module as a path>.py calling layouts.`main`, with its packages."""
    parts = module.split(".")
    for i in range(1, len(parts)):
        package = root.joinpath(*parts[:i])
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").touch()
    path = root.joinpath(*parts[:-1], parts[-1] + ".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SHIM.format(main=main))


def records(record: Path) -> dict[int, int]:
    """{device: pid} of the stand-in processes that drive a device (the pid as
    the process saw itself: in a container, its own pid namespace's)."""
    out: dict[int, int] = {}
    for entry in record.iterdir():
        if entry.name.isdigit():
            out[int(entry.read_text())] = int(entry.name)
    return out
