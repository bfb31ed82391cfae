"""The TOML config: strict loading into frozen dataclasses (reads one file).

Every key is validated at load time; an unknown key or a bad value is one
`ConfigError` that names the file and the key path ("restart.backoff_max_s").
No environment is read here: visibility variables are resolved by the caller.
The typed getters are in supervisor.config_table, the sections that build
no dataclass here (commands, accounts, placement, threads) in
supervisor.config_sections.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import urlsplit

from supervisor.config_sections import (
    ATTACH_HOWS,
    AttachTarget,
    check_env_name,
    check_exec_strings,
    check_template,
    load_account,
    load_attach,
    load_placement,
    load_threads,
    pci_addresses,
)
from supervisor.config_table import Table
from supervisor.engines.engine_kind import ENGINE_KINDS, EngineKind, ResolvedKind, recognise_kind
from supervisor.engines.kind_rules import rules_for
from supervisor.engines.rank_source import RankSource, parse_rank_source
from supervisor.errors import ConfigError
from supervisor.hostfs import SpecialFileError, read_regular_file_stat
from supervisor.listen import Listen, parse_listen
from supervisor.plan.keys import ThreadRole
from supervisor.plan.placement import PlanSettings
from supervisor.topology.accelerators import AUTO, PCI, SETTINGS, AcceleratorSetting
from supervisor.topology.model import DiscoveryOptions
from supervisor.topology.visibility import visibility_env

RestartPolicy = Literal["always", "on-failure", "never"]
DriftPolicy = Literal["observe", "enforce", "auto"]  # "auto": memory_locality only
DEFAULT_LISTEN = "127.0.0.1:9477"
WAITING_WARNING_S = 30.0  # a rank still waiting this long after the engine started: a WARNING
MAX_CPU_RANKS = 1024  # stand-in ranks on a host without accelerators; more is a typo
MIN_CHECK_INTERVAL_S = 0.05  # below this the check loop would only measure itself
MAX_API_CONNECTIONS = 65536  # one fd each: more than any API client needs; more is a typo


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
    # them (docs/contracts.md §6); `command` is then empty and `rank_from` names them.
    spawned_by: Literal["engine"] | None = None
    rank_from: tuple[RankSource, ...] = ()  # parsed; str() gives the config's text back
    # [engine] only: the engine's kind, "auto" resolved from the command
    # (supervisor.engines.engine_kind); its rules name the ranks without rank_from.
    kind: ResolvedKind = field(default="custom", kw_only=True)
    # [workers] spawned_by only: a rank waiting this long after the engine
    # started, while the tree has processes no rule matched, logs a WARNING.
    waiting_warning_s: float = field(default=WAITING_WARNING_S, kw_only=True)
    # [engine] only: the running engine to place instead of a command to spawn
    # (docs/attach.md); `command` is then empty.
    attach: AttachTarget | None = field(default=None, kw_only=True)


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
    # While inotify watches its cpuset files (a write wakes the check at once)
    # the mask is read 4x less often (supervisor.watch.cpuset_watch).
    cpuset_watch_s: float = 0.05
    policy: Mapping[str, DriftPolicy] = field(
        default_factory=lambda: {
            "thread_affinity": "enforce",
            "memory_locality": "auto",
            "irq_affinity": "enforce",
            "cpuset_changed": "enforce",
            "process_gone": "observe",
            "self_rebind": "enforce",
            "cgroup": "enforce",
        }
    )


@dataclass(frozen=True, slots=True)
class ApiConfig:
    # "HOST:PORT" or "unix:/path", parsed at load time (the server binds it as is)
    listen: Listen = field(default_factory=lambda: parse_listen(DEFAULT_LISTEN))
    unix_socket: str | None = None  # an extra socket (mode 0600): changing calls need no token
    token_file: str | None = None
    # Besides root and the supervisor's user, this group's members may make changing
    # calls over unix_socket (checked by the peer's credentials, whatever the mode).
    unix_socket_group: str | None = None
    # Open API connections at most (TCP and unix together); one more is
    # answered 503 and closed. Lowered at start so that the file descriptors
    # spawning and watching need stay free (supervisor.serve.guard).
    max_connections: int = 256
    header_timeout_s: float = 10.0  # first byte of a request to its last header line
    body_timeout_s: float = 30.0  # a request body read to its end
    idle_timeout_s: float = 60.0  # a keep-alive connection waiting for its next request


@dataclass(frozen=True, slots=True)
class Config:
    path: str | None
    engine: ProcessConfig | None
    workers: ProcessConfig
    accelerator: AcceleratorSetting = AUTO
    devices: tuple[str, ...] = ()  # PCI addresses treated as accelerators, any vendor
    cpu_ranks: int = 1  # at least this many ranks on a host without accelerators
    # PCI addresses in the runtime's logical id order (Ascend), over what the host says
    logical_ids: tuple[str, ...] = ()
    visible_devices_env: str | None = None  # None: by accelerator kind
    placement: PlanSettings = field(default_factory=PlanSettings)
    ready: ReadyProbe | None = None
    restart: RestartConfig = field(default_factory=RestartConfig)
    stop_timeout_s: float = 10.0
    # The runtime's grace between its TERM and its KILL; the stop's waits fit in it.
    stop_grace_s: float | None = None
    threads: tuple[ThreadRole, ...] = ()
    irq: IrqConfig = field(default_factory=IrqConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    cgroup: Literal["auto", "off"] = "auto"


def _process(top: Table, key: str, *, template: bool) -> ProcessConfig:
    t = top.table(key)
    if template and t.has("spawned_by"):
        return _adopted_workers(t)
    if not template and t.has("attach"):
        return _attached_engine(t)
    argv = t.command("command")
    if template:
        check_template(t, "command", argv)
    user, group = load_account(t)
    env = t.str_map("env")
    check_exec_strings(t, argv, env)
    kind: ResolvedKind = "custom"
    if not template:
        asked: EngineKind = t.choice("kind", "auto", ENGINE_KINDS)
        kind = recognise_kind(argv) if asked == "auto" else asked
        try:
            rules_for(kind, argv, env)  # the engine's own flags, read as the kind reads them
        except ValueError as err:
            raise t.fail("command", f"{err} (read as {kind}'s flag)") from None
    t.done()
    return ProcessConfig(argv, env, user=user, group=group, kind=kind)


def _attached_engine(t: Table) -> ProcessConfig:
    """[engine] attach = { unit | cgroup | match = "..." } (docs/attach.md)."""
    if t.has("command"):
        raise t.fail("attach", "give either command or attach, not both")
    target = load_attach(t, ATTACH_HOWS)
    asked: EngineKind = t.choice("kind", "auto", ENGINE_KINDS)
    # "auto" reads the kind from a match's words; a unit or cgroup tells nothing.
    argv = tuple(target.value.split()) if target.how == "match" else ()
    kind: ResolvedKind = recognise_kind(argv) if asked == "auto" else asked
    t.done()
    return ProcessConfig((), {}, kind=kind, attach=target)


def _adopted_workers(t: Table) -> ProcessConfig:
    """[workers] spawned_by = "engine" with rank_from = [...] (docs/contracts.md §6)."""
    t.choice("spawned_by", None, ("engine",))
    if t.has("command"):
        raise t.fail("command", 'give either command or spawned_by = "engine", not both')
    # Without rank_from the engine's kind names the ranks (checked with the
    # [engine] table: a "custom" engine needs rank_from).
    texts = t.str_list("rank_from")
    if t.has("rank_from") and not texts:
        raise t.fail("rank_from", "must name at least one source")
    sources: list[RankSource] = []
    for i, text in enumerate(texts):
        try:
            sources.append(parse_rank_source(text))
        except ValueError as err:
            raise t.fail("rank_from", f"item {i}: {err}") from None
    env = t.str_map("env")
    waiting_s = t.number("waiting_warning_s", WAITING_WARNING_S, 0.0, strict=True)
    t.done()
    return ProcessConfig((), env, "engine", tuple(sources), waiting_warning_s=waiting_s)


def _ready(t: Table) -> ReadyProbe | None:
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
    if probe.http is not None:
        check_http_url(t, probe.http)
    return probe


def check_http_url(t: Table, url: str) -> None:
    """`ready.http` parsed as the probe will dial it: scheme, host and port, or a
    ConfigError now (an unparsable URL made every probe fail until ready.timeout_s)."""
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port that is not 0-65535 or not a number
    except ValueError as err:
        raise t.fail("http", f"not a URL ({err}): {url!r}") from None
    if parts.scheme not in ("http", "https"):
        raise t.fail("http", f"expected an http:// URL, got {url!r}")
    if not parts.hostname:
        raise t.fail("http", f"no host in {url!r}")
    if port == 0:
        raise t.fail("http", f"port must be 1-65535, got 0 in {url!r}")


def check_listen(where: str, listen: str) -> str:
    """Validate "HOST:PORT" or "unix:/path" (also for --listen); returns it.

    The same parser the API server and `status` use, so what loads also binds."""
    parse_listen(listen, where)
    return listen


def _drift(t: Table) -> DriftConfig:
    d = DriftConfig()
    policy = dict(d.policy)
    sub = t.table("policy")
    for kind in list(sub.doc):
        if kind not in policy:
            raise sub.fail(kind, f"unknown drift kind; known: {', '.join(policy)}")
        choices: tuple[DriftPolicy, ...] = ("observe", "enforce")
        if kind == "memory_locality":
            choices = ("auto", "observe", "enforce")
        policy[kind] = sub.choice(kind, "observe", choices)
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


def _api(t: Table, listen: Listen) -> ApiConfig:
    d = ApiConfig()
    api = ApiConfig(
        listen,
        t.text("unix_socket", None),
        t.text("token_file", None),
        unix_socket_group=t.text("unix_socket_group", None),
        max_connections=t.integer("max_connections", d.max_connections, 1, MAX_API_CONNECTIONS),
        header_timeout_s=t.number("header_timeout_s", d.header_timeout_s, 0.0, strict=True),
        body_timeout_s=t.number("body_timeout_s", d.body_timeout_s, 0.0, strict=True),
        idle_timeout_s=t.number("idle_timeout_s", d.idle_timeout_s, 0.0, strict=True),
    )
    t.done()
    return api


def parse_config(
    doc: Mapping[str, Any], file: str = "<config>", *, asked: set[str] | None = None
) -> Config:
    """Validate a parsed TOML document into a Config (pure). `asked`, when given,
    collects every key path the parser reads for this document, present or not."""
    top = Table(doc, "", file, asked)
    engine = _process(top, "engine", template=False) if top.has("engine") else None
    attached = engine is not None and engine.attach is not None
    if attached and not top.has("workers"):
        # An attached engine spawns its workers: `spawned_by = "engine"` is implied.
        workers = ProcessConfig((), {}, "engine")
    elif not top.has("workers"):
        raise top.fail("workers", "is required (the worker command template)")
    else:
        workers = _process(top, "workers", template=True)
    if attached and workers.spawned_by != "engine":
        raise top.fail(
            "workers",
            'an attached engine spawns its own workers: give spawned_by = "engine" '
            "(or leave [workers] out), not a command",
        )
    accelerator: AcceleratorSetting = top.choice("accelerator", AUTO, SETTINGS)
    devices = pci_addresses(top, "devices")
    logical_ids = _logical_ids(top)
    if accelerator == PCI.name and not devices:
        raise top.fail("devices", f'accelerator = "{PCI.name}" needs at least one PCI address here')
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
    listen = parse_listen(api_t.text("listen", DEFAULT_LISTEN), f"{file}: api.listen")
    api = _api(api_t, listen)
    cfg = Config(
        path=file,
        engine=engine,
        workers=workers,
        accelerator=accelerator,
        devices=devices,
        cpu_ranks=top.integer("cpu_ranks", 1, 1, MAX_CPU_RANKS),
        logical_ids=logical_ids,
        visible_devices_env=check_env_name(top, "visible_devices_env"),
        # The [irq] table's part in the plan: IRQs are planned only when bound.
        placement=replace(
            load_placement(top.table("placement")), irqs=irq.enabled, irq_nic=irq.nic
        ),
        ready=_ready(top.table("ready")),
        restart=restart,
        stop_timeout_s=top.number("stop_timeout_s", 10.0, 0.0, strict=True),
        stop_grace_s=top.number("stop_grace_s", None, 0.0, strict=True),
        threads=load_threads(top.table("threads")),
        irq=irq,
        drift=_drift(top.table("drift")),
        api=api,
        cgroup=top.choice("cgroup", "auto", ("auto", "off")),
    )
    top.done()
    if cfg.workers.spawned_by == "engine" and cfg.engine is None:
        raise ConfigError(f'{file}: workers.spawned_by: "engine" needs an [engine] to spawn them')
    if (
        cfg.workers.spawned_by == "engine"
        and not cfg.workers.rank_from
        and cfg.engine is not None
        and cfg.engine.kind == "custom"
    ):
        raise ConfigError(
            f'{file}: workers.rank_from: is required with spawned_by = "engine" when '
            "engine.kind is custom (the command is not vllm, sglang, torchrun or ray start; "
            'set engine.kind, or e.g. rank_from = ["env:LOCAL_RANK"])'
        )
    if cfg.ready is not None and cfg.engine is None:
        raise top.fail("ready", "a readiness probe needs an [engine]")
    if attached:
        if cfg.ready is not None:
            raise top.fail(
                "ready", "not used with engine.attach: an attached engine is up once found"
            )
        # The supervisor makes no cgroups of its own for an engine it did not start: its
        # processes stay in the unit's (docs/attach.md).
        cfg = replace(cfg, cgroup="off")
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


def _logical_ids(top: Table) -> tuple[str, ...]:
    """`logical_ids`: distinct PCI addresses; item i is the device of logical id i."""
    return pci_addresses(top, "logical_ids", "0000:c1:00.0", distinct=True)


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
        logical_ids=config.logical_ids,
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
    return load_config_digest(path)[0]


def load_config_digest(path: str) -> tuple[Config, str]:
    """`load_config`, and the sha256 (hex) of the very bytes it parsed: what a
    reload shows as the config in force."""
    data, _ = _read_operator_file(path, "cannot read config", MAX_CONFIG_BYTES)
    return _parse_bytes(data, path), hashlib.sha256(data).hexdigest()


def read_config_digest(path: str) -> str:
    """The sha256 (hex) of the config file as it is on disk now, whatever it holds
    (no parse); ConfigError when it cannot be read."""
    data, _ = _read_operator_file(path, "cannot read config", MAX_CONFIG_BYTES)
    return hashlib.sha256(data).hexdigest()


def _parse_bytes(data: bytes, path: str) -> Config:
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


# Between them these documents reach every branch of parse_config: an [engine]
# with workers it spawns itself, and one whose workers the engine spawns; every
# optional table present, a [threads.<role>] and a [drift.policy] kind each.
_EVERY_BRANCH: tuple[Mapping[str, Any], ...] = (
    {
        "engine": {"command": ["engine"]},
        "workers": {"command": ["worker", "{rank}"]},
        "ready": {"tcp": "127.0.0.1:8000"},
        "threads": {"role": {"process": "engine", "pattern": "x*"}},
        "drift": {"policy": {"thread_affinity": "observe"}},
    },
    {
        "engine": {"command": ["engine"]},
        "workers": {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]},
    },
    {"engine": {"attach": {"match": "vllm serve"}, "kind": "vllm"}},
)
# A name the operator chooses, as docs/planning.md writes it.
_PLACEHOLDERS = (
    ("threads.role", "threads.<role>"),
    ("drift.policy.thread_affinity", "drift.policy.<kind>"),
)


def _with_placeholders(path: str) -> str:
    for literal, placeholder in _PLACEHOLDERS:
        path = path.replace(literal, placeholder)
    return path


def config_keys() -> tuple[str, ...]:
    """Every key path the config parser reads ("restart.backoff_factor",
    "threads.<role>.pattern"), sorted (pure): what docs/planning.md lists."""
    asked: set[str] = set()
    for doc in _EVERY_BRANCH:
        parse_config(doc, "<every key>", asked=asked)
    keys = {_with_placeholders(path) for path in asked}
    # A table is no key of its own: only its keys are (a table of names the
    # operator chooses, like [engine] env, is one key).
    return tuple(sorted(k for k in keys if not any(o.startswith(k + ".") for o in keys)))
