"""The TOML config: strict loading into frozen dataclasses (reads one file).

Every key is validated at load time; an unknown key or a bad value is one
`ConfigError` that names the file and the key path ("restart.backoff_max_s").
No environment is read here: visibility variables are resolved by the caller.
"""

from __future__ import annotations

import math
import shlex
import string
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from supervisor.errors import ConfigError
from supervisor.plan.placement import PlanSettings, Shortage, StrategySetting
from supervisor.run.rank_source import parse_rank_source
from supervisor.serve.listen import parse_listen
from supervisor.topology.model import DiscoveryOptions
from supervisor.topology.pci import normalize_bdf
from supervisor.topology.visibility import visibility_env

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
    policy: Mapping[str, DriftPolicy] = field(
        default_factory=lambda: {
            "thread_affinity": "enforce",
            "memory_locality": "observe",
            "irq_affinity": "enforce",
            "cpuset_changed": "enforce",
            "process_gone": "observe",
            "self_rebind": "enforce",
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

    def where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.file}: {self.where(key)}: {message}")

    def has(self, key: str) -> bool:
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
        if key not in self.doc:
            return default
        value: str = self._get(key, (str,), "a string")
        return value

    def flag(self, key: str, default: bool) -> bool:
        if key not in self.doc:
            return default
        value: bool = self._get(key, (bool,), "true or false")
        return value

    def integer(self, key: str, default: int, minimum: int = 0, maximum: int | None = None) -> int:
        if key not in self.doc:
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
        if key not in self.doc:
            return default
        value = float(self._get(key, (int, float), "a number"))
        if not math.isfinite(value):  # TOML allows nan and inf; no duration is either
            raise self.fail(key, f"must be a finite number, got {value}")
        if value < minimum or (strict and value == minimum):
            bound = ">" if strict else ">="
            raise self.fail(key, f"must be {bound} {minimum}, got {value}")
        return value

    def choice(self, key: str, default: T, choices: tuple[str, ...]) -> T:
        if key not in self.doc:
            return default
        value = self._get(key, (str,), "a string")
        if value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}; got {value!r}")
        return value  # type: ignore[no-any-return]

    def str_list(self, key: str) -> tuple[str, ...]:
        if key not in self.doc:
            return ()
        value = self._get(key, (list,), "a list of strings")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.fail(key, f"item {i} must be a string, got {item!r}")
        return tuple(value)

    def command(self, key: str) -> tuple[str, ...]:
        """A command as a list of strings or one shell-quoted string; required."""
        if key not in self.doc:
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
        value = self._get(key, (dict,), "a table") if key in self.doc else {}
        self.seen.add(key)
        return _Table(value, self.where(key), self.file)

    def str_map(self, key: str) -> dict[str, str]:
        sub = self.table(key)
        out = {name: sub.text(name, "") for name in sub.doc}
        sub.done()
        return out

    def int_map(self, key: str, default: Mapping[str, int]) -> dict[str, int]:
        if key not in self.doc:
            return dict(default)
        sub = self.table(key)
        out = {name: sub.integer(name, 0) for name in sub.doc}
        sub.done()
        return out

    def done(self) -> None:
        unknown = sorted(set(self.doc) - self.seen)
        if unknown:
            raise self.fail(unknown[0], "unknown key")


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


def _process(top: _Table, key: str, *, template: bool) -> ProcessConfig:
    t = top.table(key)
    if template and t.has("spawned_by"):
        return _adopted_workers(t)
    argv = t.command("command")
    if template:
        _check_template(t, "command", argv)
    env = t.str_map("env")
    t.done()
    return ProcessConfig(argv, env)


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
    given = [k for k in ("tcp", "http", "file") if getattr(probe, k) is not None]
    if len(given) != 1:
        raise t.fail("tcp", f"give exactly one of tcp, http, file (got {len(given)})")
    if probe.tcp is not None:
        host, sep, port = probe.tcp.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise t.fail("tcp", f"expected HOST:PORT, got {probe.tcp!r}")
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


def _threads(t: _Table) -> tuple[ThreadRole, ...]:
    roles: list[ThreadRole] = []
    # File order, not sorted: the first matching pattern wins, as the
    # operator wrote them (tomllib keeps table order).
    for name in t.doc:
        sub = t.table(name)
        process = sub.choice("process", None, ("engine", "workers"))
        if process is None:
            raise sub.fail("process", "is required (engine or workers)")
        pattern = sub.text("pattern", None)
        if not pattern:
            raise sub.fail("pattern", "is required (a glob over the thread name)")
        roles.append(ThreadRole(sub.text("role", name), process, pattern))
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
        placement=_placement(top.table("placement")),
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


def load_config(path: str) -> Config:
    """Read and validate a TOML config file; ConfigError names the file and key."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (TOML must be): {err.reason}") from None
    return parse_config(doc, path)
