"""The TOML config: strict loading into frozen dataclasses (reads one file).

Every key is validated at load time; an unknown key or a bad value is one
`ConfigError` that names the file and the key path ("restart.backoff_max_s").
No environment is read here: visibility variables are resolved by the caller.
Over 500 lines because it is the schema: each table's dataclass sits with its
validator, so a key's type, default and check read in one place.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import shlex
import stat
import string
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any, Literal, TypeVar

from supervisor.errors import ConfigError
from supervisor.hostfs import SpecialFileError, read_regular_file_stat
from supervisor.plan.placement import PlanSettings, Shortage, StrategySetting
from supervisor.serve.listen import parse_listen
from supervisor.topology.model import DiscoveryOptions
from supervisor.topology.pci import normalize_bdf
from supervisor.topology.visibility import visibility_env
from supervisor.trees.rank_source import parse_rank_source

RestartPolicy = Literal["always", "on-failure", "never"]
DriftPolicy = Literal["observe", "enforce"]
AcceleratorSetting = Literal["auto", "nvidia", "amd", "ascend", "pci", "cpu"]
DEFAULT_LISTEN = "127.0.0.1:9477"
MAX_CPU_RANKS = 1024  # stand-in ranks on a host without accelerators; more is a typo
MIN_CHECK_INTERVAL_S = 0.05  # below this the check loop would only measure itself
COMMAND_FIELDS = ("rank", "local_rank", "device_index", "bus_id", "world_size")


@dataclass(frozen=True, slots=True)
class ReadyProbe:
    """How to know the engine is up before workers start: one of the three."""

    tcp: str | None = None  # "127.0.0.1:8000"
    http: str | None = None  # "http://127.0.0.1:8000/health"
    file: str | None = None  # a path the engine creates
    timeout_s: float = 120.0


@dataclass(frozen=True, slots=True)
class ProcessConfig:
    """The engine, or the worker template (argv may hold {rank} and friends)."""

    command: tuple[str, ...]
    # Run as this account (the shim drops root after binding, before exec);
    # None keeps the supervisor's. `group` None: the user's primary group.
    # Keyword-only: positional construction elsewhere never lands here.
    user: str | None = field(default=None, kw_only=True)
    group: str | None = field(default=None, kw_only=True)
    env: Mapping[str, str] = field(default_factory=dict)  # set only where unset
    # [workers] only: the engine spawns the workers and the supervisor adopts
    # them (DESIGN 3.6); `command` is then empty and `rank_from` names them.
    spawned_by: Literal["engine"] | None = None
    rank_from: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ThreadRole:
    """Threads of `process` whose OS name (comm) matches `pattern` get `role`'s CPUs."""

    role: str
    process: Literal["engine", "workers"]
    pattern: str  # fnmatch glob over /proc/<pid>/task/<tid>/comm (15 chars)
    # Module-name prefixes: a ThreadPoolExecutor created in one of them is
    # renamed `<role>-N`, sized and bound by the start-up hook (supervisor.hook).
    executors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RestartConfig:
    policy: RestartPolicy = "on-failure"
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    backoff_factor: float = 2.0
    crash_loop_limit: int = 5  # this many failed starts within the window -> failed
    crash_loop_window_s: float = 120.0
    stable_after_s: float = 30.0  # a run this long resets the backoff


@dataclass(frozen=True, slots=True)
class IrqConfig:
    enabled: bool = True
    nic: bool = False  # also bind the nearest NIC's IRQs to the rank's irq CPUs
    irqbalance: Literal["ban", "observe"] = "ban"


@dataclass(frozen=True, slots=True)
class DriftConfig:
    check_interval_s: float = 1.0
    numa_maps_interval_s: float = 10.0
    local_memory_threshold: float = 0.9
    migrate_max_bytes_per_s: int = 1 << 30
    enforce_pinned: bool = False  # re-bind threads the workload pinned inside their role
    # The loop's own CPU mask (cpuset writes, hotplug) is read this often apart
    # from the full check, which runs at once on a change; 0: only the check.
    cpuset_watch_s: float = 0.05
    policy: Mapping[str, DriftPolicy] = field(
        default_factory=lambda: {
            "thread_affinity": "enforce",
            "memory_locality": "observe",
            "irq_affinity": "enforce",
            "cpuset_changed": "enforce",
            "process_gone": "observe",
            "self_rebind": "enforce",
            "cgroup": "enforce",
        }
    )


@dataclass(frozen=True, slots=True)
class ApiConfig:
    listen: str = DEFAULT_LISTEN  # "HOST:PORT" or "unix:/path"
    unix_socket: str | None = None  # an extra socket (mode 0600): changing calls need no token
    token_file: str | None = None


@dataclass(frozen=True, slots=True)
class Config:
    path: str | None
    engine: ProcessConfig | None
    workers: ProcessConfig
    accelerator: AcceleratorSetting = "auto"
    devices: tuple[str, ...] = ()  # PCI addresses treated as accelerators, any vendor
    cpu_ranks: int = 1  # at least this many ranks on a host without accelerators
    visible_devices_env: str | None = None  # None: by accelerator kind
    placement: PlanSettings = field(default_factory=PlanSettings)
    ready: ReadyProbe | None = None
    restart: RestartConfig = field(default_factory=RestartConfig)
    stop_timeout_s: float = 10.0
    threads: tuple[ThreadRole, ...] = ()
    irq: IrqConfig = field(default_factory=IrqConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    cgroup: Literal["auto", "off"] = "auto"


T = TypeVar("T")


class _Table:
    """A TOML table being read: typed getters that name the key path on error,
    and `done()` that rejects keys nobody asked for."""

    def __init__(self, doc: Mapping[str, Any], path: str, file: str) -> None:
        self.doc = doc
        self.path = path
        self.file = file
        self.seen: set[str] = set()
        self.known: set[str] = set()  # every key asked for, present or not: for suggestions

    def where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.file}: {self.where(key)}: {message}")

    def has(self, key: str) -> bool:
        self.known.add(key)
        return key in self.doc

    def _asked(self, key: str) -> bool:
        """Note `key` as a known key; True when the document holds it."""
        self.known.add(key)
        return key in self.doc

    def _get(self, key: str, kinds: tuple[type, ...], expected: str) -> Any:
        self.seen.add(key)
        value = self.doc[key]
        # bool is an int in Python; a TOML `true` is never a number here.
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(key, f"expected {expected}, got {value!r}")
        if not isinstance(value, kinds):
            raise self.fail(key, f"expected {expected}, got {value!r}")
        return value

    def text(self, key: str, default: T) -> str | T:
        if not self._asked(key):
            return default
        value: str = self._get(key, (str,), "a string")
        return value

    def flag(self, key: str, default: bool) -> bool:
        if not self._asked(key):
            return default
        value: bool = self._get(key, (bool,), "true or false")
        return value

    def integer(self, key: str, default: int, minimum: int = 0, maximum: int | None = None) -> int:
        if not self._asked(key):
            return default
        value: int = self._get(key, (int,), "an integer")
        if value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be <= {maximum}, got {value}")
        return value

    def number(
        self, key: str, default: float, minimum: float = 0.0, *, strict: bool = False
    ) -> float:
        if not self._asked(key):
            return default
        value = float(self._get(key, (int, float), "a number"))
        if not math.isfinite(value):  # TOML allows nan and inf; no duration is either
            raise self.fail(key, f"must be a finite number, got {value}")
        if value < minimum or (strict and value == minimum):
            bound = ">" if strict else ">="
            raise self.fail(key, f"must be {bound} {minimum}, got {value}")
        return value

    def choice(self, key: str, default: T, choices: tuple[str, ...]) -> T:
        if not self._asked(key):
            return default
        value = self._get(key, (str,), "a string")
        if value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}; got {value!r}")
        return value  # type: ignore[no-any-return]

    def str_list(self, key: str) -> tuple[str, ...]:
        if not self._asked(key):
            return ()
        value = self._get(key, (list,), "a list of strings")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.fail(key, f"item {i} must be a string, got {item!r}")
        return tuple(value)

    def command(self, key: str) -> tuple[str, ...]:
        """A command as a list of strings or one shell-quoted string; required."""
        if not self._asked(key):
            raise self.fail(key, "is required")
        raw = self._get(key, (str, list), "a list of strings or a string")
        if isinstance(raw, str):
            try:
                argv = tuple(shlex.split(raw))
            except ValueError as err:
                raise self.fail(key, f"cannot split {raw!r}: {err}") from None
        else:
            argv = self.str_list(key)
        if not argv or not argv[0]:
            raise self.fail(key, "must not be empty")
        return argv

    def table(self, key: str) -> _Table:
        value = self._get(key, (dict,), "a table") if self._asked(key) else {}
        self.seen.add(key)
        return _Table(value, self.where(key), self.file)

    def str_map(self, key: str) -> dict[str, str]:
        sub = self.table(key)
        out = {name: sub.text(name, "") for name in sub.doc}
        sub.done()
        return out

    def int_map(self, key: str, default: Mapping[str, int]) -> dict[str, int]:
        if not self._asked(key):
            return dict(default)
        sub = self.table(key)
        out = {name: sub.integer(name, 0) for name in sub.doc}
        sub.done()
        return out

    def done(self) -> None:
        unknown = sorted(set(self.doc) - self.seen)
        if unknown:
            raise self.fail(unknown[0], "unknown key" + suggest_key(unknown[0], self.known))


def suggest_key(key: str, known: set[str]) -> str:
    """The "; did you mean `x`?" tail naming the nearest known key, or "" (pure).

    difflib's default cutoff (ratio >= 0.6) catches a dropped, doubled or
    swapped letter (`stop_timout_s`) without suggesting unrelated keys.
    """
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _check_template(table: _Table, key: str, argv: tuple[str, ...]) -> None:
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


def _check_exec_strings(t: _Table, argv: tuple[str, ...], env: Mapping[str, str]) -> None:
    """What execve(2) cannot pass: a NUL ends a C string, so the child would get
    another argv than the config says (the spawn failed, and nothing said so);
    an env key that is empty or holds `=` is not a variable (environ(7))."""
    for i, word in enumerate(argv):
        if "\0" in word:
            raise t.fail("command", f"item {i} contains a NUL byte: {word!r}")
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise t.fail("env", f"bad variable name {name!r}: empty, or holds '=' or a NUL")
        if "\0" in value:
            raise t.fail(f"env.{name}", f"contains a NUL byte: {value!r}")


def _process(top: _Table, key: str, *, template: bool) -> ProcessConfig:
    t = top.table(key)
    if template and t.has("spawned_by"):
        return _adopted_workers(t)
    argv = t.command("command")
    if template:
        _check_template(t, "command", argv)
    user, group = _account(t)
    env = t.str_map("env")
    _check_exec_strings(t, argv, env)
    t.done()
    return ProcessConfig(argv, env, user=user, group=group)


def _account(t: _Table) -> tuple[str | None, str | None]:
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


def _adopted_workers(t: _Table) -> ProcessConfig:
    """[workers] spawned_by = "engine" with rank_from = [...] (DESIGN 3.6)."""
    t.choice("spawned_by", None, ("engine",))
    if t.has("command"):
        raise t.fail("command", 'give either command or spawned_by = "engine", not both')
    if not t.has("rank_from"):
        raise t.fail(
            "rank_from", 'is required with spawned_by = "engine" (e.g. ["env:LOCAL_RANK"])'
        )
    sources = t.str_list("rank_from")
    if not sources:
        raise t.fail("rank_from", "must name at least one source")
    for i, text in enumerate(sources):
        try:
            parse_rank_source(text)
        except ValueError as err:
            raise t.fail("rank_from", f"item {i}: {err}") from None
    env = t.str_map("env")
    t.done()
    return ProcessConfig((), env, "engine", sources)


def _ready(t: _Table) -> ReadyProbe | None:
    if not t.doc:
        t.done()
        return None
    probe = ReadyProbe(
        tcp=t.text("tcp", None),
        http=t.text("http", None),
        file=t.text("file", None),
        timeout_s=t.number("timeout_s", 120.0, 0.0, strict=True),
    )
    t.done()
    kinds = {"tcp": probe.tcp, "http": probe.http, "file": probe.file}
    given = [k for k, v in kinds.items() if v is not None]
    if len(given) != 1:
        raise t.fail("tcp", f"give exactly one of tcp, http, file (got {len(given)})")
    if probe.tcp is not None:
        host, sep, port = probe.tcp.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise t.fail("tcp", f"expected HOST:PORT, got {probe.tcp!r}")
        if not 1 <= int(port) <= 65535:  # a larger one wrapped modulo 65536 when dialled
            raise t.fail("tcp", f"port must be 1-65535, got {port} in {probe.tcp!r}")
    if probe.http is not None and not probe.http.startswith(("http://", "https://")):
        raise t.fail("http", f"expected an http:// URL, got {probe.http!r}")
    return probe


def check_listen(where: str, listen: str) -> str:
    """Validate "HOST:PORT" or "unix:/path" (also for --listen); returns it.

    The same parser the API server and `status` use, so what loads also binds."""
    parse_listen(listen, where)
    return listen


def _placement(t: _Table) -> PlanSettings:
    defaults = PlanSettings()
    engine = t.table("engine")
    on_shortage: Shortage | None = t.choice("on_shortage", None, ("error", "merge", "share"))
    strategy: StrategySetting = t.choice(
        "strategy", defaults.strategy, ("auto", "numa-affine", "global-slice")
    )
    settings = PlanSettings(
        strategy=strategy,
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


def _executors(sub: _Table, role: str, pattern: str | None) -> tuple[tuple[str, ...], str | None]:
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


def _threads(t: _Table) -> tuple[ThreadRole, ...]:
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


def _drift(t: _Table) -> DriftConfig:
    d = DriftConfig()
    policy = dict(d.policy)
    sub = t.table("policy")
    for kind in list(sub.doc):
        if kind not in policy:
            raise sub.fail(kind, f"unknown drift kind; known: {', '.join(policy)}")
        policy[kind] = sub.choice(kind, "observe", ("observe", "enforce"))
    sub.done()
    threshold = t.number("local_memory_threshold", d.local_memory_threshold)
    if threshold > 1.0:
        raise t.fail("local_memory_threshold", f"must be between 0 and 1, got {threshold}")
    cfg = DriftConfig(
        check_interval_s=t.number("check_interval_s", d.check_interval_s, MIN_CHECK_INTERVAL_S),
        numa_maps_interval_s=t.number("numa_maps_interval_s", d.numa_maps_interval_s, 0.0),
        local_memory_threshold=threshold,
        migrate_max_bytes_per_s=t.integer("migrate_max_bytes_per_s", d.migrate_max_bytes_per_s, 0),
        enforce_pinned=t.flag("enforce_pinned", d.enforce_pinned),
        cpuset_watch_s=t.number("cpuset_watch_s", d.cpuset_watch_s, 0.0),
        policy=policy,
    )
    t.done()
    return cfg


def parse_config(doc: Mapping[str, Any], file: str = "<config>") -> Config:
    """Validate a parsed TOML document into a Config (pure)."""
    top = _Table(doc, "", file)
    engine = _process(top, "engine", template=False) if top.has("engine") else None
    if not top.has("workers"):
        raise top.fail("workers", "is required (the worker command template)")
    workers = _process(top, "workers", template=True)
    accelerator: AcceleratorSetting = top.choice(
        "accelerator", "auto", ("auto", "nvidia", "amd", "ascend", "pci", "cpu")
    )
    devices = top.str_list("devices")
    normalized = []
    for i, text in enumerate(devices):
        bdf = normalize_bdf(text)
        if bdf is None:
            raise top.fail(
                "devices", f"item {i}: expected a PCI address like 0000:41:00.0, got {text!r}"
            )
        normalized.append(bdf)
    devices = tuple(normalized)
    if accelerator == "pci" and not devices:
        raise top.fail("devices", 'accelerator = "pci" needs at least one PCI address here')
    restart_t = top.table("restart")
    r = RestartConfig()
    restart = RestartConfig(
        policy=restart_t.choice("policy", r.policy, ("always", "on-failure", "never")),
        backoff_initial_s=restart_t.number("backoff_initial_s", r.backoff_initial_s),
        backoff_max_s=restart_t.number("backoff_max_s", r.backoff_max_s),
        backoff_factor=restart_t.number("backoff_factor", r.backoff_factor, 1.0),
        crash_loop_limit=restart_t.integer("crash_loop_limit", r.crash_loop_limit, 1),
        crash_loop_window_s=restart_t.number("crash_loop_window_s", r.crash_loop_window_s),
        stable_after_s=restart_t.number("stable_after_s", r.stable_after_s),
    )
    restart_t.done()
    if restart.backoff_max_s < restart.backoff_initial_s:
        raise restart_t.fail("backoff_max_s", "must be >= backoff_initial_s")
    if restart.crash_loop_window_s == 0 and restart.backoff_initial_s == 0:
        # No window never counts a crash loop, and no backoff restarts at
        # once: a crashing process would be restarted as fast as it can fork.
        raise restart_t.fail(
            "crash_loop_window_s",
            "0 together with backoff_initial_s = 0 restarts a crashing process without "
            "pause or limit; give one of them a value above 0",
        )
    irq_t = top.table("irq")
    irq = IrqConfig(
        enabled=irq_t.flag("enabled", True),
        nic=irq_t.flag("nic", False),
        irqbalance=irq_t.choice("irqbalance", "ban", ("ban", "observe")),
    )
    irq_t.done()
    api_t = top.table("api")
    listen = api_t.text("listen", DEFAULT_LISTEN)
    check_listen(f"{file}: api.listen", listen)
    api = ApiConfig(listen, api_t.text("unix_socket", None), api_t.text("token_file", None))
    api_t.done()
    cfg = Config(
        path=file,
        engine=engine,
        workers=workers,
        accelerator=accelerator,
        devices=devices,
        cpu_ranks=top.integer("cpu_ranks", 1, 1, MAX_CPU_RANKS),
        visible_devices_env=top.text("visible_devices_env", None),
        # The [irq] table's part in the plan: IRQs are planned only when bound.
        placement=replace(_placement(top.table("placement")), irqs=irq.enabled, irq_nic=irq.nic),
        ready=_ready(top.table("ready")),
        restart=restart,
        stop_timeout_s=top.number("stop_timeout_s", 10.0, 0.0, strict=True),
        threads=_threads(top.table("threads")),
        irq=irq,
        drift=_drift(top.table("drift")),
        api=api,
        cgroup=top.choice("cgroup", "auto", ("auto", "off")),
    )
    top.done()
    if cfg.workers.spawned_by == "engine" and cfg.engine is None:
        raise ConfigError(f'{file}: workers.spawned_by: "engine" needs an [engine] to spawn them')
    if cfg.ready is not None and cfg.engine is None:
        raise top.fail("ready", "a readiness probe needs an [engine]")
    if cfg.engine is not None and not cfg.placement.engine:
        # Without a slot the engine would silently not run at all.
        raise ConfigError(
            f"{file}: placement.engine.enabled: false, but [engine] gives a command; "
            "remove [engine] to run no engine, or let it have its slot"
        )
    if cfg.engine is None and cfg.placement.engine:
        # No [engine] table: nothing runs there, so no CPUs are set aside for it.
        cfg = replace(cfg, placement=replace(cfg.placement, engine=False))
    return cfg


def discovery_options(config: Config | None, environ: Mapping[str, str]) -> DiscoveryOptions:
    """What discovery is told: the config's device keys (or the defaults) and the
    visibility variables of `environ` (the caller's environment, read by the caller)."""
    env = visibility_env(environ)
    if config is None:
        return DiscoveryOptions(env=env)
    return DiscoveryOptions(
        accelerator=config.accelerator,
        pci_devices=config.devices,
        cpu_ranks=config.cpu_ranks,
        env=env,
    )


MAX_CONFIG_BYTES = 1 << 20  # the shipped configs are a few KiB
MAX_TOKEN_BYTES = 1 << 16


def _read_operator_file(path: str, what: str, max_bytes: int) -> tuple[bytes, os.stat_result]:
    """A file the operator names: regular, capped, never blocking on a FIFO."""
    try:
        data, st = read_regular_file_stat(path, max_bytes)  # the mode of the file read
    except OSError as err:
        raise ConfigError(f"{path}: {what}: {err.strerror or err}") from None
    except SpecialFileError as err:  # a FIFO, a device, a directory, too large
        raise ConfigError(f"{path}: {what}: {str(err).removeprefix(path + ': ')}") from None
    return data, st


def load_config(path: str) -> Config:
    """Read and validate a TOML config file; ConfigError names the file and key."""
    data, _ = _read_operator_file(path, "cannot read config", MAX_CONFIG_BYTES)
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (TOML must be): {err.reason}") from None
    return parse_config(doc, path)


def read_token_file(path: str) -> bytes:
    """The API bearer token (api.token_file), stripped; ConfigError when the file is
    not a regular file, is empty, or the group or others may read or write it
    (as ssh refuses a key; the same rule as `plan --config`'s preflight)."""
    data, st = _read_operator_file(path, "api.token_file: cannot read", MAX_TOKEN_BYTES)
    token = data.strip()
    if not token:
        raise ConfigError(f"{path}: api.token_file: the file is empty")
    if st.st_mode & 0o077:  # as ssh: a key the group or others may touch is no secret
        raise ConfigError(
            f"{path}: api.token_file: readable or writable by others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 {path}"
        )
    return token
