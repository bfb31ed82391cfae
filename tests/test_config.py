"""The TOML config: every bad input is one ConfigError naming the file and key path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from supervisor.config import check_listen, config_keys, load_config, parse_config
from supervisor.errors import ConfigError
from supervisor.listen import Listen

MINIMAL = {"workers": {"command": ["python3", "-m", "w", "--rank", "{rank}"]}}


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_minimal_config_gets_defaults() -> None:
    cfg = parse_config(MINIMAL, "x.toml")
    assert cfg.engine is None
    assert cfg.placement.engine is False  # no [engine]: no CPUs set aside for one
    assert cfg.workers.command[-1] == "{rank}"
    assert cfg.restart.policy == "on-failure"
    assert cfg.placement.rank_roles == {"irq": 1, "comm": 1}
    assert cfg.placement.engine_roles == {"so_compiler": 4}
    assert cfg.api.listen == Listen(host="127.0.0.1", port=9477)  # parsed at load time
    assert cfg.stop_grace_s is None  # no grace known: every wait is stop_timeout_s
    assert parse_config({**MINIMAL, "stop_grace_s": 30}, "x.toml").stop_grace_s == 30.0
    assert cfg.drift.policy["memory_locality"] == "auto"  # moves pages of unbound processes
    assert cfg.drift.policy["thread_affinity"] == "enforce"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'stop_timout_s = 5\n[workers]\ncommand = "w"',
            "c.toml: stop_timout_s: unknown key; did you mean `stop_timeout_s`?",
        ),
        (
            '[workers]\ncommand = "w"\n[restart]\ncrash_loop_limt = 3',
            "c.toml: restart.crash_loop_limt: unknown key; did you mean `crash_loop_limit`?",
        ),
        (
            '[workers]\ncommand = "w"\nusr = "nobody"',
            "c.toml: workers.usr: unknown key; did you mean `user`?",
        ),
        # A key that is near nothing gets no guess.
        ('[workers]\ncommand = "w"\n[api]\nbanana = 1', "c.toml: api.banana: unknown key"),
    ],
)
def test_an_unknown_key_suggests_the_nearest_known_one(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert str(info.value) == message.replace("c.toml", str(tmp_path / "c.toml"))


def test_engine_and_workers_user_and_group() -> None:
    doc = {
        "engine": {"command": ["e"], "user": "nobody", "group": "nogroup"},
        "workers": {"command": ["w"], "user": "nobody"},
    }
    cfg = parse_config(doc, "c.toml")
    assert cfg.engine is not None
    assert (cfg.engine.user, cfg.engine.group) == ("nobody", "nogroup")
    assert (cfg.workers.user, cfg.workers.group) == ("nobody", None)
    assert parse_config(MINIMAL).workers.user is None


@pytest.mark.parametrize(
    ("workers", "needle"),
    [
        ({"group": "video"}, "c.toml: workers.group: needs `user` too"),
        ({"user": ""}, "c.toml: workers.user: must not be empty"),
        ({"user": 65534}, "c.toml: workers.user: expected a string, got 65534"),
    ],
)
def test_bad_user_or_group(workers: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("`", ".")):
        parse_config({"workers": {"command": ["w"], **workers}}, "c.toml")


def test_full_config_round_trips(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
accelerator = "nvidia"
devices = ["0000:41:00.0"]
cpu_ranks = 2
stop_timeout_s = 5

[engine]
command = "python3 -m vllm.entrypoints.openai.api_server --port 8000"
env = { HCCL_CONNECT_TIMEOUT = "240" }

[workers]
command = ["python3", "-m", "w", "--rank", "{rank}", "--bus", "{bus_id}"]

[placement]
strategy = "global-slice"
on_shortage = "merge"
rank_roles = { irq = 2, comm = 1, acl = 1, release = 1 }
[placement.engine]
main_cpus = 4
roles = { so_compiler = 8 }

[ready]
http = "http://127.0.0.1:8000/health"
timeout_s = 30

[restart]
policy = "always"
backoff_initial_s = 0.5
backoff_max_s = 8

[threads.so_compiler]
process = "engine"
pattern = "so-compile-*"

[drift]
check_interval_s = 0.5
policy = { memory_locality = "enforce" }

[api]
listen = "unix:/run/ps.sock"
token_file = "/etc/ps/token"
""",
    )
    cfg = load_config(path)
    assert cfg.engine is not None and cfg.engine.command[0] == "python3"
    assert cfg.placement.engine is True
    assert cfg.engine.env == {"HCCL_CONNECT_TIMEOUT": "240"}
    assert cfg.devices == ("0000:41:00.0",)
    assert cfg.placement.strategy == "global-slice"
    assert cfg.placement.rank_roles["acl"] == 1
    assert cfg.placement.engine_main_cpus == 4
    assert cfg.placement.engine_roles == {"so_compiler": 8}
    assert cfg.ready is not None and cfg.ready.http is not None and cfg.ready.timeout_s == 30
    assert cfg.threads[0].role == "so_compiler" and cfg.threads[0].process == "engine"
    assert cfg.drift.policy["memory_locality"] == "enforce"
    assert cfg.drift.policy["irq_affinity"] == "enforce"
    assert cfg.api.listen == Listen(path="/run/ps.sock")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[workers]\ncommand = "w"\n[restart]\npolcy = "always"', "restart.polcy: unknown key"),
        (
            '[workers]\ncommand = "w"\n[restart]\npolicy = "sometimes"',
            "restart.policy: must be one of",
        ),
        (
            '[workers]\ncommand = "w"\n[restart]\nbackoff_max_s = "x"',
            "restart.backoff_max_s: expected a number",
        ),
        (
            '[workers]\ncommand = "w"\n[restart]\ncrash_loop_limit = 0',
            "restart.crash_loop_limit: must be >= 1",
        ),
        ('[workers]\ncommand = "w {gpu}"', "workers.command: bad placeholder {gpu} in '{gpu}'"),
        ("[workers]\ncommand = []", "workers.command: must not be empty"),
        ('stop_timeout_s = 0\n[workers]\ncommand = "w"', "stop_timeout_s: must be > 0"),
        ('stop_grace_s = 0\n[workers]\ncommand = "w"', "stop_grace_s: must be > 0"),
        (
            'devices = ["41:00.0"]\n[workers]\ncommand = "w"',
            "devices: item 0: expected a PCI address",
        ),
        ('[workers]\ncommand = "w"\n[api]\nlisten = "localhost"', "api.listen: expected HOST:PORT"),
        ('[workers]\ncommand = "w"\n[placement]\nrank_roles = { main = 3 }', "`main` is not sized"),
        (
            '[workers]\ncommand = "w"\n[placement]\nrank_roles = { irq = true }',
            "placement.rank_roles.irq: expected an integer",
        ),
        (
            '[workers]\ncommand = "w"\n[drift.policy]\nthread_afinity = "enforce"',
            "drift.policy.thread_afinity: unknown drift kind",
        ),
        (
            '[workers]\ncommand = "w"\n[drift]\nlocal_memory_threshold = 1.5',
            "drift.local_memory_threshold: must be between 0 and 1",
        ),
        (
            '[workers]\ncommand = "w"\n[threads.comm]\npattern = "x"',
            "threads.comm.process: is required",
        ),
        ('[workers]\ncommand = "w"\n[ready]\ntcp = "8000"', "ready.tcp: expected HOST:PORT"),
        (
            '[workers]\ncommand = "w"\n[engine]\ncommand = "e"\n[ready]\ntcp = "h:1"\nfile = "/x"',
            "give exactly one of",
        ),
        (
            '[workers]\ncommand = "w"\n[ready]\nfile = "/x"',
            "ready: a readiness probe needs an [engine]",
        ),
        (
            '[engine]\ncommand = "e"\n[workers]\ncommand = "w"\n'
            "[placement.engine]\nenabled = false",
            "placement.engine.enabled: false, but [engine] gives a command",
        ),
        ('[engine]\ncommand = "e"', "workers: is required"),
        ("workers = 3", "workers: expected a table"),
        (
            'stop_timeout_s = nan\n[workers]\ncommand = "w"',
            "stop_timeout_s: must be a finite number",
        ),
        (
            '[workers]\ncommand = "w"\n[restart]\nbackoff_max_s = inf',
            "backoff_max_s: must be a finite",
        ),
        (
            '[workers]\ncommand = "w"\n[drift]\ncheck_interval_s = 0.001',
            "check_interval_s: must be >= 0.05",
        ),
        ('cpu_ranks = 100000\n[workers]\ncommand = "w"', "cpu_ranks: must be <= 1024"),
        ('[workers]\ncommand = "w {rank!r}"', "bad placeholder {rank!r}"),
        ('[workers]\ncommand = "w {rank:>99999999}"', "bad placeholder {rank:>99999999}"),
        ('[workers]\ncommand = "w {rank.real}"', "bad placeholder {rank.real}"),
        ('[workers]\ncommand = "w {"', "bad placeholder in '{': Single '{'"),
        (
            '[workers]\ncommand = "w"\n[placement.engine]\nroles = { main = 1 }',
            "placement.engine.roles: `main` is not sized",
        ),
        ('[workers]\ncommand = "w\n', "not valid TOML"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(path + ": "), message
    assert needle in message, message
    assert info.value.exit_code == 2


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[workers]\ncommand = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(str(path))


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(str(tmp_path / "nope.toml"))


@pytest.mark.parametrize("listen", ["127.0.0.1:9477", "[::1]:80", "unix:/run/x.sock", "h:0"])
def test_listen_accepts(listen: str) -> None:
    assert check_listen("--listen", listen) == listen


@pytest.mark.parametrize("listen", ["127.0.0.1", ":80", "h:port", "h:70000", "unix:"])
def test_listen_rejects(listen: str) -> None:
    with pytest.raises(ConfigError, match="--listen"):
        check_listen("--listen", listen)


def test_pci_addresses_are_normalized_to_the_sysfs_spelling() -> None:
    doc = {"devices": ["0000:3B:00.0", "00000000:41:00.1"], "workers": {"command": "w"}}
    assert parse_config(doc).devices == ("0000:3b:00.0", "0000:41:00.1")


def test_pci_accelerator_needs_devices() -> None:
    with pytest.raises(ConfigError, match='devices: accelerator = "pci" needs'):
        parse_config({"accelerator": "pci", "workers": {"command": "w"}})


# -- what execve cannot pass, and values that wrap or spin (issue 11, item 4) ---------


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        (
            {"workers": {"command": ["w", "a\0b"]}},
            "workers.command: item 1 contains a NUL byte",
        ),
        (
            {"workers": {"command": "w"}, "engine": {"command": ["e\0"]}},
            "engine.command: item 0 contains a NUL byte",
        ),
        (
            {"workers": {"command": "w", "env": {"HF_HOME": "/x\0y"}}},
            "workers.env.HF_HOME: contains a NUL byte",
        ),
        (
            {"workers": {"command": "w", "env": {"A=B": "1"}}},
            "workers.env: bad variable name 'A=B'",
        ),
        ({"workers": {"command": "w", "env": {"": "1"}}}, "workers.env: bad variable name ''"),
        (
            {
                "workers": {"command": "w"},
                "restart": {"crash_loop_window_s": 0, "backoff_initial_s": 0},
            },
            "restart.crash_loop_window_s: 0 together with backoff_initial_s = 0",
        ),
        (
            {"workers": {"command": "w"}, "engine": {"command": "e"}, "ready": {"tcp": "h:85638"}},
            "ready.tcp: port must be 1-65535, got 85638",
        ),
        (
            {"workers": {"command": "w"}, "engine": {"command": "e"}, "ready": {"tcp": "h:0"}},
            "ready.tcp: port must be 1-65535, got 0",
        ),
    ],
)
def test_unrunnable_values_are_config_errors(doc: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match="^c.toml: " + needle.replace("(", r"\(")):
        parse_config(doc, "c.toml")


def test_a_window_or_a_backoff_alone_may_be_zero() -> None:
    for restart in ({"crash_loop_window_s": 0}, {"backoff_initial_s": 0}):
        parse_config({"workers": {"command": "w"}, "restart": restart})
    ready = {"tcp": "127.0.0.1:65535"}
    assert parse_config({"workers": {"command": "w"}, "engine": {"command": "e"}, "ready": ready})


# -- [api] connection limits --------------------------------------------------------------


def test_api_connection_limits_default_and_load(tmp_path: Path) -> None:
    cfg = parse_config(MINIMAL, "x.toml")
    assert cfg.api.max_connections == 256
    assert (cfg.api.header_timeout_s, cfg.api.body_timeout_s, cfg.api.idle_timeout_s) == (
        10.0,
        30.0,
        60.0,
    )
    text = (
        '[workers]\ncommand = "w"\n[api]\nmax_connections = 32\n'
        "header_timeout_s = 2.5\nbody_timeout_s = 4\nidle_timeout_s = 7\n"
    )
    api = load_config(write(tmp_path, text)).api
    assert (api.max_connections, api.header_timeout_s, api.body_timeout_s) == (32, 2.5, 4.0)
    assert api.idle_timeout_s == 7.0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("max_connections = 0", "api.max_connections: must be >= 1, got 0"),
        ("max_connections = 70000", "api.max_connections: must be <= 65536, got 70000"),
        ('max_connections = "many"', "api.max_connections: expected an integer, got 'many'"),
        ("max_connections = true", "api.max_connections: expected an integer, got True"),
        ("max_connections = 2.5", "api.max_connections: expected an integer, got 2.5"),
        ("header_timeout_s = 0", "api.header_timeout_s: must be > 0.0, got 0.0"),
        ("body_timeout_s = -1", "api.body_timeout_s: must be > 0.0, got -1.0"),
        ("idle_timeout_s = inf", "api.idle_timeout_s: must be a finite number, got inf"),
        ("max_conections = 5", "api.max_conections: unknown key; did you mean `max_connections`?"),
    ],
)
def test_bad_api_connection_limits_name_the_key(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, f'[workers]\ncommand = "w"\n[api]\n{line}\n'))
    assert str(info.value) == f"{tmp_path / 'c.toml'}: {message}"


def _documented_keys() -> list[str]:
    """The first column of docs/planning.md's key table: `a.b`, `a.c` / `a.d` each a key."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "planning.md").read_text()
    section = text.split("## Configuration", 1)[1]
    keys: list[str] = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            keys += re.findall(r"`([^`]+)`", first)
    return keys


def test_the_docs_table_lists_every_key_the_parser_reads() -> None:
    documented = _documented_keys()
    assert len(documented) == len(set(documented)), "a key documented twice"
    parsed = set(config_keys())
    assert sorted(parsed - set(documented)) == [], "keys the parser reads, not in docs/planning.md"
    assert sorted(set(documented) - parsed) == [], "keys in docs/planning.md the parser never reads"


def test_config_keys_follows_the_parser() -> None:
    """What config_keys() lists is what the parser asks for: every listed key loads,
    and a key next to them is refused by name."""
    keys = config_keys()
    assert {
        "restart.backoff_factor",
        "engine.kind",
        "workers.rank_from",
        "drift.policy.<kind>",
    } <= set(keys)
    assert "restart" not in keys and "threads.<role>" not in keys  # tables are not keys
    with pytest.raises(ConfigError, match=r"restart\.backoff_factr: unknown key; did you mean"):
        parse_config({"workers": {"command": ["w"]}, "restart": {"backoff_factr": 2}})
