"""Attach mode: the accelerators an attached engine sees, by its own visibility variables.

A host with two engine services (the Ascend document's example: one on NPUs 0-7,
one on 8-15), each attached by its own supervisor, sets `CUDA_VISIBLE_DEVICES`
(`ASCEND_RT_VISIBLE_DEVICES`, ...) in each engine's unit. A supervisor whose own
environment has none would plan every device of the host, and take the second
engine's LOCAL_RANK 0 for the host's device 0. So at start, where the engine
runs already and the supervisor's environment sets no visibility variable, the
engine's are planned (`with_engine_visibility`); an engine found later whose
variables select other devices than the plan is warned about
(`visibility_difference`): the plan is made once, at start (a restart plans again).

Only an engine under this supervisor's own root: in a container (another root)
the indices count the container's devices, not the host's; the node agent
hands a container's devices over as `engine.attach.devices` instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from supervisor.errors import KernelError, TopologyError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
from supervisor.procfs.files import read_environ
from supervisor.topology.accelerators import VISIBILITY_VARIABLES
from supervisor.topology.model import Device
from supervisor.topology.visibility import apply_visibility, visibility_env

log = logging.getLogger("supervisor.attach")


def same_root(fs: HostFS, pid: int) -> bool:
    """Whether `pid` sees the filesystem from this process's root (no chroot, no
    container's pivot_root): /proc/<pid>/root is the same directory as ours."""
    try:
        ours = os.stat(fs.path("proc/self/root"))
        theirs = os.stat(fs.path(f"proc/{pid}/root"))
    except OSError:  # gone, or no ptrace access: not known to be ours
        return False
    return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)


def engine_visibility(fs: HostFS, pid: int) -> dict[str, str] | None:
    """The visibility variables set in `pid`'s environment; None when they do not
    count this host's devices (another root) or cannot be read (gone, refused)."""
    if not same_root(fs, pid):
        return None
    try:
        return read_environ(fs, pid, VISIBILITY_VARIABLES)
    except KernelError:
        return None


def with_engine_visibility(
    env: Mapping[str, str], engine: Mapping[str, str] | None
) -> Mapping[str, str]:
    """`env` (the supervisor's) with the engine's visibility variables where `env`
    sets none (pure but for the log line)."""
    if not engine or visibility_env(env):
        return env
    log.info(
        "engine visibility %s action=plan the devices it sees",
        format_fields(**dict(sorted(engine.items()))),
    )
    return {**env, **engine}


def visibility_difference(
    devices: Sequence[Device], planned_env: Mapping[str, str], engine: Mapping[str, str]
) -> str | None:
    """What the engine's variables (`engine`) select that the plan's (`planned_env`,
    the supervisor's at start) did not, in words; None when they select the same
    devices in the same order (pure)."""

    def selected(env: Mapping[str, str]) -> list[str]:
        chosen = [d for d in apply_visibility(tuple(devices), env) if d.visible]
        return [d.label for d in sorted(chosen, key=lambda d: (d.kind, d.ordinal or 0))]

    planned = selected(dict(visibility_env(planned_env)))
    try:
        seen = selected(engine)
    except TopologyError as err:
        return f"its visibility variables do not fit this host: {err}"
    if seen == planned:
        return None
    words = ", ".join(f"{k}={v!r}" for k, v in sorted(engine.items())) or "none set"
    return (
        f"it sees {', '.join(seen) or 'no device'} ({words}), the plan has "
        f"{', '.join(planned) or 'no device'}"
    )
