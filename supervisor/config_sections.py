"""Config sections that build no config dataclass of their own (pure, no I/O).

Command templates and what execve(2) can pass, [engine]/[workers] accounts,
[placement] (into the plan's PlanSettings) and [threads.*] (into ThreadRoles,
with the start-up hook's `executors`); `supervisor.config` calls them.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

from supervisor.config_table import Table
from supervisor.cpulist import parse_cpulist
from supervisor.plan.keys import ThreadRole
from supervisor.plan.placement import Allocator, PlanSettings, Shortage, StrategySetting
from supervisor.topology.pci import normalize_bdf

COMMAND_FIELDS = ("rank", "local_rank", "device_index", "bus_id", "world_size")
AttachHow = Literal["unit", "cgroup", "match"]
ATTACH_HOWS: tuple[AttachHow, ...] = ("unit", "cgroup", "match")


def check_template(table: Table, key: str, argv: tuple[str, ...]) -> None:
    """Placeholders are plain `{name}`: no attribute, index, conversion or format
    spec (`{rank:>99999999}` would allocate at every spawn)."""
    allowed = ", ".join("{" + n + "}" for n in COMMAND_FIELDS)
    for word in argv:
        try:
            fields = list(string.Formatter().parse(word))
        except ValueError as err:
            raise table.fail(
                key, f"bad placeholder in {word!r}: {err}; allowed: {allowed}"
            ) from None
        for _, name, spec, conversion in fields:
            if name is None:
                continue
            if name not in COMMAND_FIELDS or spec or conversion:
                shown = "{" + name + ("!" + conversion if conversion else "")
                shown += (":" + spec if spec else "") + "}"
                raise table.fail(key, f"bad placeholder {shown} in {word!r}; allowed: {allowed}")


def is_env_name(name: str) -> bool:
    """What execve(2) can pass as a variable name (and os.environ accepts): not
    empty, no `=` (it ends the name, environ(7)), no NUL (it ends the string)."""
    return bool(name) and "=" not in name and "\0" not in name


def check_env_name(t: Table, key: str) -> str | None:
    """The text at `key`, which names an environment variable ("" as unset);
    ConfigError if it cannot be one."""
    name = t.text(key, None)
    if name and not is_env_name(name):
        raise t.fail(key, f"bad variable name {name!r}: empty, or holds '=' or a NUL")
    return name


def check_exec_strings(t: Table, argv: tuple[str, ...], env: Mapping[str, str]) -> None:
    """What execve(2) cannot pass: a NUL ends a C string, so the child would get
    another argv than the config says (the spawn failed, and nothing said so);
    an env key that is empty or holds `=` is not a variable (environ(7))."""
    for i, word in enumerate(argv):
        if "\0" in word:
            raise t.fail("command", f"item {i} contains a NUL byte: {word!r}")
    for name, value in env.items():
        if not is_env_name(name):
            raise t.fail("env", f"bad variable name {name!r}: empty, or holds '=' or a NUL")
        if "\0" in value:
            raise t.fail(f"env.{name}", f"contains a NUL byte: {value!r}")


def load_account(t: Table) -> tuple[str | None, str | None]:
    """`user` and `group` of [engine] or [workers]: names or numbers, looked up at start."""
    user = t.text("user", None)
    group = t.text("group", None)
    if user == "":
        raise t.fail("user", "must not be empty (leave it out to keep the supervisor's user)")
    if group is not None and user is None:
        raise t.fail("group", "needs `user` too (the group of which account?)")
    if group == "":
        raise t.fail("group", "must not be empty (leave it out for the user's primary group)")
    return user, group


def load_placement(t: Table) -> PlanSettings:
    defaults = PlanSettings()
    engine = t.table("engine")
    on_shortage: Shortage | None = t.choice("on_shortage", None, ("error", "merge", "share"))
    strategy: StrategySetting = t.choice(
        "strategy", defaults.strategy, ("auto", "numa-affine", "global-slice")
    )
    allocator: Allocator = t.choice(
        "allocator", defaults.allocator, ("supervisor", "topo_affinity", "global_slice")
    )
    settings = PlanSettings(
        strategy=strategy,
        allocator=allocator,
        rank_roles=t.int_map("rank_roles", defaults.rank_roles),
        min_main_cpus=t.integer("min_main_cpus", defaults.min_main_cpus, 1),
        engine=engine.flag("enabled", True),
        engine_main_cpus=engine.integer("main_cpus", defaults.engine_main_cpus, 1),
        engine_roles=engine.int_map("roles", defaults.engine_roles),
        reserve_hidden=t.flag("reserve_hidden", defaults.reserve_hidden),
        on_shortage=on_shortage,
        devices_per_rank=t.integer("devices_per_rank", defaults.devices_per_rank, 1),
    )
    engine.done()
    t.done()
    main_sized = "`main` is not sized: it holds every CPU no other role takes"
    if "main" in settings.rank_roles:
        raise t.fail("rank_roles", main_sized)
    if "main" in settings.engine_roles:
        raise engine.fail("roles", main_sized + " (size it with main_cpus)")
    return settings


# An `executors` prefix is a dotted module name ("vllm.v1.structured_output").
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


# The hook names pool threads "<role>-N" and comm keeps 15 bytes: a role of at
# most 12 keeps "-NN" visible; its characters must be literal in a glob.
_HOOK_ROLE = re.compile(r"[A-Za-z0-9_]{1,12}")


def _executors(sub: Table, role: str, pattern: str | None) -> tuple[tuple[str, ...], str | None]:
    """`executors` of a [threads.*] table, validated, and the pattern its role gets."""
    executors = sub.str_list("executors")
    if not sub.has("executors"):
        return executors, pattern
    if not executors:
        raise sub.fail("executors", "must name at least one module prefix")
    for i, prefix in enumerate(executors):
        if not _MODULE_NAME.fullmatch(prefix):
            raise sub.fail(
                "executors",
                f"item {i}: expected a module name like vllm.v1.structured_output, got {prefix!r}",
            )
    if not _HOOK_ROLE.fullmatch(role):
        raise sub.fail(
            "role" if sub.has("role") else "executors",
            f"role {role!r} names the hook's threads ({role}-N, 15 bytes kept): "
            "use at most 12 letters, digits or _",
        )
    hook_glob = f"{role}-[0-9]*"
    if pattern is None:
        return executors, hook_glob
    if not fnmatchcase(f"{role}-0", pattern):
        raise sub.fail(
            "pattern",
            f"{pattern!r} does not match the hook's thread names ({role}-0, {role}-1, ...); "
            f"leave pattern out (it defaults to {hook_glob!r}) or widen it",
        )
    return executors, pattern


def load_threads(t: Table) -> tuple[ThreadRole, ...]:
    roles: list[ThreadRole] = []
    # File order, not sorted: the first matching pattern wins, as the
    # operator wrote them (tomllib keeps table order).
    for name in t.doc:
        sub = t.table(name)
        process = sub.choice("process", None, ("engine", "workers"))
        if process is None:
            raise sub.fail("process", "is required (engine or workers)")
        role = sub.text("role", name)
        executors, pattern = _executors(sub, role, sub.text("pattern", None))
        if not pattern:
            raise sub.fail("pattern", "is required (a glob over the thread name)")
        roles.append(ThreadRole(role, process, pattern, executors))
        sub.done()
    t.done()
    return tuple(roles)


def pci_addresses(
    t: Table, key: str, example: str = "0000:41:00.0", *, distinct: bool = False
) -> tuple[str, ...]:
    """`key = ["0000:41:00.0", ...]`: PCI addresses, each normalized (lower case,
    with a domain); the item that is not one (or, `distinct`, is one again) is named."""
    out: list[str] = []
    for i, text in enumerate(t.str_list(key)):
        bdf = normalize_bdf(text)
        if bdf is None:
            raise t.fail(key, f"item {i}: expected a PCI address like {example}, got {text!r}")
        if distinct and bdf in out:
            raise t.fail(key, f"item {i}: {text!r} is listed twice")
        out.append(bdf)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class AttachTarget:
    """`[engine] attach = { unit = "vllm.service" }`, `{ cgroup = "/x.slice/y" }` or
    `{ match = "vllm serve" }`: how the supervisor finds an engine it did not start."""

    how: AttachHow
    value: str
    # `cpus = "0-7"`: the plan stays within these CPUs of the engine's cpuset (the
    # node agent's share of a container whose CPUs other containers share too).
    cpus: frozenset[int] | None = None
    # `devices = ["0000:41:00.0", ...]`: the accelerators the engine can reach (the
    # node agent: its container's device nodes); the plan has these and none of the
    # host's others, not even hidden (docs/attach.md). None: every one of the host's.
    devices: tuple[str, ...] | None = None

    def __str__(self) -> str:
        return f"{self.how} = {self.value!r}"


def load_attach(engine: Table, hows: tuple[AttachHow, ...]) -> AttachTarget:
    """`[engine] attach = { unit | cgroup | match = "...", cpus = "0-7", devices = [...] }`:
    exactly one of `hows`, and the optional CPUs and accelerators the plan is
    narrowed to, checked."""
    sub = engine.table("attach")
    given = [how for how in hows if sub.has(how)]
    unknown = sorted(k for k in sub.doc if k not in (*hows, "cpus", "devices"))
    if unknown:
        raise sub.fail(unknown[0], f"unknown attach key; give one of {', '.join(hows)}")
    if len(given) != 1:
        raise engine.fail("attach", f"give exactly one of {', '.join(hows)}")
    how = given[0]
    value = sub.text(how, "").strip()
    if not value or "\0" in value:
        raise sub.fail(how, "must be a non-empty string without NUL bytes")
    if how == "cgroup" and not value.startswith("/"):
        raise sub.fail(how, f"a cgroup path starts with / (as in /proc/PID/cgroup), got {value!r}")
    if how == "unit" and "/" in value:
        raise sub.fail(how, f"a unit name, not a path, got {value!r}")
    cpus: frozenset[int] | None = None
    if sub.has("cpus"):
        text = sub.text("cpus", "")
        try:
            cpus = parse_cpulist(text)
        except ValueError as err:
            raise sub.fail("cpus", f'not a CPU list like "0-7,16": {err}') from None
        if not cpus:
            raise sub.fail("cpus", 'must name at least one CPU (a list like "0-7,16")')
    devices: tuple[str, ...] | None = None
    if sub.has("devices"):
        devices = pci_addresses(sub, "devices", distinct=True)
    sub.done()
    return AttachTarget(how, value, cpus, devices)
