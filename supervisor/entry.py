"""The `placement-supervisor` entry point: SIGHUP ignored before anything else runs
(no I/O but the signal disposition).

A HUP (a closed terminal's, `systemctl reload` too early, a script's) must never
kill the daemon, and the default disposition kills. The heavy imports (asyncio,
aiohttp, the planner) take most of a second, so the disposition is SIG_IGN from
this module's first statement; `run` then replaces it with its reload handler
(supervisor.daemon.hangup), and every other command gets the default back.
"""

from __future__ import annotations

import signal
import sys

signal.signal(signal.SIGHUP, signal.SIG_IGN)


def main() -> int:
    """`supervisor.cli.main`, with SIGHUP ignored until `run` takes it over."""
    from supervisor.cli import main as cli_main  # noqa: PLC0415 - after the signal, on purpose

    words = [word for word in sys.argv[1:] if not word.startswith("-")]
    if words[:1] != ["run"]:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # only the daemon outlives a terminal
        return cli_main()
    try:
        return cli_main()
    finally:
        # However `run` ended (an error exit 2 or 3 too): the interpreter's exit
        # resets a Python handler to SIG_DFL, SIG_IGN it keeps.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
