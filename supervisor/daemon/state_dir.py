"""Where the daemon keeps state across its own restarts: the IRQ checkpoint (does I/O:
makes and checks the directory; restores a checkpoint left behind).

systemd's StateDirectory= (exported as $STATE_DIRECTORY, systemd.exec(5)), else
the shipped unit's /var/lib/placement-supervisor, else a per-user tmp dir; one
file per instance, named as the instance lock is (`instance_lock.lock_name`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from supervisor.bind.irq_checkpoint import IrqCheckpoint, read_boot_id, restore_checkpoint
from supervisor.daemon.instance_lock import lock_name, systemd_dirs, usable_dir
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields

log = logging.getLogger("placement_supervisor.daemon")

DEFAULT_STATE_DIR = "/var/lib/placement-supervisor"


def state_dirs(env: Mapping[str, str]) -> list[str]:
    """Where state may live, best first (pure): StateDirectory=, then the default."""
    return systemd_dirs(env, "STATE_DIRECTORY", DEFAULT_STATE_DIR, "placement-supervisor-state")


def irq_checkpoint_name(instance: str) -> str:
    """The checkpoint file's name for `instance` ("" is the default instance) (pure)."""
    return lock_name(instance).removesuffix(".lock") + ".irqs.json"


def irq_checkpoint_path(instance: str, env: Mapping[str, str]) -> str:
    """The IRQ checkpoint file of `instance` in the first usable state dir; in the
    first one tried when none is usable (its writes fail, so no IRQ is moved: an
    original in memory only is lost to a SIGKILL; the start reports the capability)."""
    tried = state_dirs(env)
    for d in tried:
        if usable_dir(d):
            return os.path.join(d, irq_checkpoint_name(instance))
    log.warning(
        "state dir none %s",
        format_fields(tried=",".join(tried), action="no irq is moved"),
    )
    return os.path.join(tried[0], irq_checkpoint_name(instance))


def irq_checkpoint_for(instance: str, env: Mapping[str, str], fs: HostFS) -> IrqCheckpoint:
    """This start's IRQ checkpoint, after restoring one the last daemon left (call
    while holding the instance lock, before discovery). Blocking.

    A checkpoint still there means the last daemon of this instance and its
    guardian both died with IRQs moved: the host's own affinities go back
    first, and only then does this daemon read what it will keep as originals.
    """
    path = irq_checkpoint_path(instance, env)
    restore_checkpoint(fs, path)
    return IrqCheckpoint(path, read_boot_id(fs))
