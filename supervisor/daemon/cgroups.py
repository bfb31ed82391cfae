"""The supervised processes' cgroups: one per process key, in this instance's own dir
(does I/O through `supervisor.bind.cgroup`).

`cgroups_for` finds a writable subtree and prepares it once, before any spawn;
`ManagedCgroups` makes each process's cgroup at its first start and reuses it
after (re-made, when someone removed it, at each start and by the check
loop's `repair`); `instance_suffix` names the instance's dir (pure).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Mapping, Sequence

from supervisor.bind.cgroup import CgroupManager, ProcessCgroup, read_cgroup_setup
from supervisor.config import Config
from supervisor.daemon.instance_lock import INSTANCE_ENV
from supervisor.errors import ConfigError, KernelError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
from supervisor.plan.keys import ProcKey, key_label
from supervisor.plan.placement import Slot
from supervisor.state import Capability
from supervisor.trees.guardian import sweep_leftovers

log = logging.getLogger("placement_supervisor.daemon")

__all__ = ["INSTANCE_ENV", "ManagedCgroups", "cgroups_for", "instance_suffix", "remove_cgroups"]


class ManagedCgroups:
    """`ProcessCgroups` (supervisor.run.runner) over a `CgroupManager`: one cgroup per
    process key ("engine", "rank0", ...), made at its first start, reused after."""

    def __init__(self, manager: CgroupManager) -> None:
        self.manager = manager
        self.made: dict[ProcKey, ProcessCgroup] = {}

    @staticmethod
    def name(key: ProcKey) -> str:
        return "engine" if key == "engine" else f"rank{key}"

    @property
    def instance_dirs(self) -> tuple[str, ...]:
        """This instance's dirs (one per hierarchy), relative to the HostFS root."""
        return self.manager.instance_dirs

    def cpuset_dir(self, key: ProcKey) -> str | None:
        """The dir whose cgroup.procs lists `key`'s processes (its cpuset on v2, its
        memory cgroup on v1, which has no per-process cpusets); None before its first start."""
        pc = self.made.get(key)
        return None if pc is None else pc.procs_dir

    def create(self, key: ProcKey, slot: Slot) -> tuple[str, ...]:
        """Before each start: the cgroup made (again, when someone removed it) and set."""
        pc = self.manager.create(self.name(key), slot.cpus, slot.mems)
        self.made[key] = pc
        return pc.dirs

    def repair(self, key: ProcKey, slot: Slot, pids: Sequence[int]) -> None:
        """The check loop: `key`'s cgroup as planned again, `pids` back in it."""
        pc = self.made.get(key)
        if pc is not None:
            self.manager.repair(pc, slot.cpus, slot.mems, pids)

    def remove(self, key: ProcKey) -> None:
        pc = self.made.pop(key, None)
        if pc is not None:
            self.manager.remove(pc)

    def close(self) -> None:
        self.manager.close()


def instance_suffix(config: Config, env: Mapping[str, str]) -> str:
    """The per-instance cgroup dir suffix (pure).

    INSTANCE_ENV when set; else the config file's name plus a hash of its
    absolute path, so that two supervisors on one host (two single-GPU
    services, each with its own config) never write each other's cgroups on
    a shared v1 hierarchy, while a restarted supervisor finds its own again.
    """
    explicit = env.get(INSTANCE_ENV)
    if explicit is not None or config.path is None:
        return explicit or ""
    path = os.path.abspath(config.path)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.splitext(os.path.basename(path))[0])
    return f"{stem}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def cgroups_for(config: Config, fs: HostFS, env: Mapping[str, str]) -> ManagedCgroups | None:
    """Per-process cgroups when `cgroup = "auto"` and a writable subtree exists,
    in a dir of this instance's own (`instance_suffix`)."""
    return cgroups_and_capability(config, fs, env)[0]


def cgroups_and_capability(
    config: Config, fs: HostFS, env: Mapping[str, str]
) -> tuple[ManagedCgroups | None, Capability]:
    """`cgroups_for`, and the "cgroup" capability it found (with why not)."""
    if config.cgroup == "off":
        return None, Capability("cgroup", False, wanted=False, reason='cgroup = "off"')
    setup, why = read_cgroup_setup(fs)
    if setup is None:
        log.info(
            "cgroups none %s",
            format_fields(reason="no writable cgroup subtree", detail=why, action="skip"),
        )
        return None, Capability("cgroup", False, reason=f"no writable cgroup subtree: {why}")
    suffix = instance_suffix(config, env)
    try:
        manager = CgroupManager(fs, setup, suffix=suffix)
    except ValueError as err:
        raise ConfigError(f"{INSTANCE_ENV}={suffix!r}: {err}") from None
    cgroups, error = _prepared(manager, setup.version)
    return cgroups, Capability("cgroup", cgroups is not None, reason=error)


def _prepared(manager: CgroupManager, version: int) -> tuple[ManagedCgroups | None, str | None]:
    try:
        # Once, here, before any runner spawns: preparing lazily from the
        # executor's threads raced, and a failure was redone at every spawn.
        manager.prepare()
    except KernelError as err:
        # One line, with the kernel's cause (EBUSY: processes left in the cgroup;
        # EOPNOTSUPP/ENOENT: a controller not delegated after all; EROFS, EACCES).
        log.warning(
            "cgroups none %s",
            format_fields(reason="cannot make child cgroups", detail=str(err), action="skip"),
        )
        return None, f"cannot make child cgroups: {err}"
    # What an earlier instance of this config left (it died with its guardian) ends first.
    try:
        sweep_leftovers(manager)
    except BaseException:
        manager.close()  # a start that fails here leaves no instance dir behind
        raise
    log.info(
        "cgroups %s",
        format_fields(
            version=version, parent=manager.setup.cpuset_parent, instance=manager.instance
        ),
    )
    return ManagedCgroups(manager), None


def remove_cgroups(cgroups: ManagedCgroups, keys: Sequence[ProcKey]) -> None:
    """Each process's cgroup, then the instance's dirs (best effort; blocking)."""
    for key in keys:
        try:
            cgroups.remove(key)
        except (KernelError, OSError) as err:
            log.warning("cgroup remove failed %s", format_fields(rank=key_label(key), error=err))
    with contextlib.suppress(KernelError, OSError):
        cgroups.close()
