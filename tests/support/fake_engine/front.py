"""The fake engine's front process: starts one spawn child that compiles grammars.

    python -m tests.support.fake_engine.front OUT_DIR [COMPILER_THREADS]

Writes OUT_DIR/front.pid, then waits for the child (vLLM's API server waits
on its EngineCore the same way).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

from tests.support.fake_engine.structured_output import compile_until


def main() -> None:
    out = Path(sys.argv[1])
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    (out / "front.pid").write_text(str(os.getpid()))
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=compile_until, args=(out, threads), name="EngineCore")
    child.start()
    child.join()
    sys.exit(child.exitcode or 0)


if __name__ == "__main__":
    main()
