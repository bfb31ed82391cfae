"""What to run for each supervised process (pure, no I/O): argv, environment, slot.

`build_specs` turns the config and the plan into one `ChildSpec` for the
engine (when planned) and one per rank; `supervisor.run.runner` spawns them.
`PlanSpecs` is each process's spec of the plan in force (rebuilt after an install).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from supervisor.config import Config, ProcessConfig
from supervisor.engines.early import EARLY_ENV, early_rules
from supervisor.engines.kind_rules import rules_for
from supervisor.hook import HOOK_ENV, hook_env, hook_roles
from supervisor.in_force import PlanInForce
from supervisor.plan.keys import ProcKey
from supervisor.plan.placement import Placement, RankPlacement, Slot
from supervisor.state import MemPolicyStep
from supervisor.topology.accelerators import BY_NAME, DeviceKind
from supervisor.worker import SLOT_ENV, slot_env_value

if TYPE_CHECKING:
    from supervisor.run.users import Account

# Variables the daemon must not hand to its children: a child that inherits
# NOTIFY_SOCKET could notify on our behalf (NotifyAccess=main ignores it, but
# a stray READY=1 is confusing), and WATCHDOG_* describe our pid, not theirs.
NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """Everything needed to start one supervised process, before the shim wraps it."""

    key: ProcKey
    argv: tuple[str, ...]
    env: Mapping[str, str]
    slot: Slot
    account: Account | None = None  # run as this user (PlanSpecs)
    # The shim's memory policy: "local" for an engine whose children are the
    # workers (they must not inherit a binding to the engine's node).
    mempolicy: MemPolicyStep = "bind"


SpecOf = Callable[[ProcKey], ChildSpec]
"""What a runner asks at each spawn: its process's spec now."""


class PlanSpecs:
    """Every process's `ChildSpec` of the plan in force, each with its account (the
    engine's, the workers') and that account's HOME/USER/LOGNAME; built again when
    an install replaced the plan, so each spawn runs by the plan in force."""

    def __init__(
        self,
        plan: PlanInForce,
        env: Mapping[str, str],
        python: str,
        accounts: Mapping[str, Account],
    ) -> None:
        self.plan = plan
        self.env = dict(env)
        self.python = python
        self.accounts = dict(accounts)
        self._generation = -1
        self._specs: dict[ProcKey, ChildSpec] = {}

    def __call__(self, key: ProcKey) -> ChildSpec:
        return self.by_key()[key]

    def by_key(self) -> Mapping[ProcKey, ChildSpec]:
        if self._generation != self.plan.generation:
            out: dict[ProcKey, ChildSpec] = {}
            for spec in build_specs(self.plan.config, self.plan.placement, self.env, self.python):
                account = self.accounts.get("engine" if spec.key == "engine" else "workers")
                out[spec.key] = (
                    spec
                    if account is None
                    else replace(spec, account=account, env={**spec.env, **account.env()})
                )
            self._specs, self._generation = out, self.plan.generation
        return self._specs


def visible_devices_var(kind: DeviceKind, override: str | None) -> str | None:
    """The variable naming a rank's devices: the config's, else the kind's
    (`worker_var`, as in DeepInfer's assign_visible_devices), else none: `cpu`
    stand-ins and config-named `pci` devices have none."""
    if override:
        return override
    record = BY_NAME.get(kind)
    return None if record is None else record.worker_var


def visible_value(rank: RankPlacement, var: str, base_env: Mapping[str, str]) -> str:
    """The rank's own device(s), as the worker's visibility variable names them.

    By index (PCI bus order, with CUDA_DEVICE_ORDER=PCI_BUS_ID by default);
    by UUID where the operator's list in `var` (one of the kind's visibility
    variables that takes UUIDs, CUDA_VISIBLE_DEVICES) names devices by UUID,
    because a UUID means the same GPU whatever CUDA_DEVICE_ORDER says. The
    rank itself is the device's place in the operator's list (docs/contracts.md §3).
    """
    devices = rank.all_devices
    record = BY_NAME.get(rank.device.kind)
    prefix = None if record is None or var not in record.visibility else record.uuid_prefix
    listed = base_env.get(var, "") if prefix is not None else ""
    by_uuid = prefix is not None and any(
        e.strip().upper().startswith(prefix) for e in listed.split(",")
    )
    if by_uuid and all(d.uuid for d in devices):
        return ",".join(str(d.uuid) for d in devices)
    return ",".join(str(d.index) for d in devices)


def command_fields(rank: RankPlacement, world_size: int) -> dict[str, object]:
    devices = rank.all_devices
    return {
        "rank": rank.rank,
        "local_rank": rank.local_rank,
        "device_index": ",".join(str(d.index) for d in devices),
        "bus_id": ",".join(d.bus_id or "" for d in devices),
        "world_size": world_size,
    }


def worker_argv(template: Sequence[str], rank: RankPlacement, world_size: int) -> tuple[str, ...]:
    """The worker command with {rank}, {local_rank}, {device_index}, {bus_id}, {world_size}."""
    fields = command_fields(rank, world_size)
    return tuple(word.format(**fields) for word in template)


def child_env(
    base: Mapping[str, str],
    defaults: Mapping[str, str],
    forced: Mapping[str, str],
    drop: Sequence[str] = (),
) -> dict[str, str]:
    """`base` (the operator's environment) + `defaults` where unset + `forced`, minus `drop`.

    Defaults use set-if-unset semantics (the seed's HCCL timeouts: an
    operator who tuned HCCL_CONNECT_TIMEOUT for the cluster keeps the value);
    `forced` is what only the supervisor can know (the slot, the device).
    """
    env = {k: v for k, v in base.items() if k not in drop and k not in NOTIFY_VARS}
    for name, value in defaults.items():
        env.setdefault(name, value)
    env.update(forced)
    return env


PYTHON_NAMES = ("python", "python3")


def resolve_python(argv: Sequence[str], python: str) -> tuple[str, ...]:
    """A command whose first word is exactly `python` or `python3` runs under
    the supervisor's own interpreter (pure).

    The demo and most engine configs say `python -m ...` and mean the
    environment the supervisor is installed in; a systemd unit's PATH would
    otherwise find the system interpreter. Any other word, or a path, is kept.
    """
    if argv and argv[0] in PYTHON_NAMES:
        return (python, *argv[1:])
    return tuple(argv)


# The engine tree's copy of every rank's slot (the start-up hook's RANK_SLOTS_ENV).
RANK_SLOTS_ENV = "PLACEMENT_SUPERVISOR_RANK_SLOTS"


def rank_slots_value(placement: Placement) -> str:
    """{"<rank>": slot} of every rank, each as `slot_env_value` writes it: an
    adopted process's pools are sized and bound by its rank's slot (the hook
    reads which rank's cgroup it sits in), not the engine's it inherited."""
    docs = {
        str(r.rank): json.loads(slot_env_value(r.rank, r.slot.to_doc())) for r in placement.ranks
    }
    return json.dumps(docs, separators=(",", ":"))


def engine_early_rules(config: Config, placement: Placement) -> str | None:
    """The start-up hook's early rank rules for the engine's tree (trees.early),
    or None: workers not spawned by the engine, or no rule can name a rank
    before the worker's code runs."""
    if config.engine is None or config.workers.spawned_by != "engine":
        return None
    engine = config.engine
    rules = rules_for(engine.kind, engine.command, engine.env)
    return early_rules(rules, config.workers.rank_from, placement)


def build_specs(
    config: Config,
    placement: Placement,
    base_env: Mapping[str, str],
    python: str = sys.executable,
    supervisor_pid: int | None = None,
) -> list[ChildSpec]:
    """The engine (when planned) then one spec per rank, in rank order.

    Roles with `executors` turn on the start-up hook (`supervisor.hook`) in
    the trees of their `process` kind; it acts only below `supervisor_pid`
    (default: this process, the one that spawns them).
    """
    sup_pid = os.getpid() if supervisor_pid is None else supervisor_pid
    specs: list[ChildSpec] = []
    if config.engine is not None and placement.engine is not None:
        slot = placement.engine
        env = child_env(
            base_env,
            config.engine.env,
            {SLOT_ENV: slot_env_value("engine", slot.to_doc())},
        )
        # Adopted workers inherit the engine's environment: its hook carries
        # their roles too (the hook names pools; the daemon matches per process).
        kinds = ("engine", "workers") if config.workers.spawned_by == "engine" else ("engine",)
        early = engine_early_rules(config, placement)
        roles = hook_roles(config.threads, kinds)
        env.update(hook_env(env, roles, sup_pid, early=early is not None))
        if early is not None:
            # The hook binds a worker it can name to its rank's slot at start-up.
            env[EARLY_ENV] = early
        if config.workers.spawned_by == "engine" and HOOK_ENV in env:
            # An adopted process's pools follow its rank's slot (the hook reads
            # its cgroup, or the rank it bound itself to at start-up).
            env[RANK_SLOTS_ENV] = rank_slots_value(placement)
        # An engine that spawns the workers passes its memory policy to each
        # of them (fork and execve keep it): MPOL_LOCAL there, so a worker's
        # pages follow the CPUs its adoption (or the start-up hook) gives it.
        policy: MemPolicyStep = "local" if config.workers.spawned_by == "engine" else "bind"
        argv = resolve_python(config.engine.command, python)
        specs.append(ChildSpec("engine", argv, env, slot, mempolicy=policy))
    world_size = len(placement.ranks)
    worker_hook = hook_roles(config.threads, ("workers",))
    for rank in placement.ranks:
        spec = _rank_spec(config.workers, config, rank, world_size, base_env)
        env = {**spec.env, **hook_env(spec.env, worker_hook, sup_pid)}
        specs.append(replace(spec, argv=resolve_python(spec.argv, python), env=env))
    return specs


def _rank_spec(
    workers: ProcessConfig,
    config: Config,
    rank: RankPlacement,
    world_size: int,
    base_env: Mapping[str, str],
) -> ChildSpec:
    record = BY_NAME.get(rank.device.kind)
    forced = {SLOT_ENV: slot_env_value(rank.rank, rank.slot.to_doc())}
    drop: list[str] = []
    var = visible_devices_var(rank.device.kind, config.visible_devices_env)
    if var is not None:
        forced[var] = visible_value(rank, var, base_env)
        if record is not None and var == record.worker_var:
            # HIP indexes into what ROCR_VISIBLE_DEVICES leaves; our index is
            # over all devices, so the operator's ROCR filter must not apply.
            drop.extend(record.worker_drops)
    # Defaults apply only where the operator's environment (or the config)
    # leaves them unset.
    defaults = dict({} if record is None else record.worker_defaults)
    defaults.update(workers.env)
    env = child_env(base_env, defaults, forced, drop)
    return ChildSpec(rank.rank, worker_argv(workers.command, rank, world_size), env, rank.slot)
