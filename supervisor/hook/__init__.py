"""The engine start-up hook, supervisor side: what goes in a child's environment (pure).

`[threads.<role>] executors = [...]` (docs/contracts.md §7) is carried out inside the
engine's own Python by `pythonpath/sitecustomize.py`, a stdlib-only file the
engine imports at start-up. This module builds the two variables that turn
it on for one supervised process and its whole tree (they are inherited):
`PYTHONPATH` with the hook's directory first, and `PLACEMENT_SUPERVISOR_HOOK`
naming the supervisor's pid (the hook acts only below it) and each role's
module prefixes. The slot itself travels in `PLACEMENT_SUPERVISOR_SLOT`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from supervisor.plan.keys import ThreadRole

HOOK_ENV = "PLACEMENT_SUPERVISOR_HOOK"
# Only sitecustomize.py and placement_supervisor_early.py (a name no engine's
# module has) live here: anything else in a PYTHONPATH directory could shadow
# the engine's own top-level modules.
HOOK_DIR = str(Path(__file__).resolve().parent / "pythonpath")


def hook_roles(roles: Sequence[ThreadRole], kinds: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """{role: module prefixes} of the roles with `executors` for these process kinds.

    Two tables of one role merge their prefixes, in file order, once each.
    """
    out: dict[str, list[str]] = {}
    for role in roles:
        if role.executors and role.process in kinds:
            prefixes = out.setdefault(role.role, [])
            prefixes.extend(p for p in role.executors if p not in prefixes)
    return {name: tuple(prefixes) for name, prefixes in out.items()}


def format_hook_env(supervisor_pid: int, roles: Mapping[str, Sequence[str]]) -> str:
    """`pid=SUP;ROLE=PREFIX,PREFIX;...`, what the hook's `parse_hook_env` reads.

    Role names and prefixes are validated by the config ([A-Za-z0-9_] and
    dotted module names), so `;`, `=` and `,` never occur inside them.
    """
    parts = [f"pid={supervisor_pid}"]
    parts.extend(f"{role}={','.join(prefixes)}" for role, prefixes in roles.items())
    return ";".join(parts)


def hook_env(
    env: Mapping[str, str],
    roles: Mapping[str, Sequence[str]],
    supervisor_pid: int,
    *,
    early: bool = False,
) -> dict[str, str]:
    """The variables to set in `env` (a child's final environment) to hook it.

    Empty when no role lists executors and `early` is False (no early rank
    rule, supervisor.engines.early): an engine without them runs exactly as
    before. The hook's directory goes first on PYTHONPATH, ahead of what the
    operator or the config put there (kept, in order).
    """
    if not roles and not early:
        return {}
    path = HOOK_DIR
    # An empty entry means the working directory; an empty PYTHONPATH means none.
    if env.get("PYTHONPATH"):
        rest = [p for p in env["PYTHONPATH"].split(os.pathsep) if p != HOOK_DIR]
        path = os.pathsep.join([HOOK_DIR, *rest])
    return {"PYTHONPATH": path, HOOK_ENV: format_hook_env(supervisor_pid, roles)}
