"""The `status` command: GET /placement from a running daemon, print it (does I/O: HTTP).

I/O: one HTTP request over TCP or the unix socket (stdlib http.client, so the
command stays light). `render_status(doc)` is the pure table renderer.
Exit codes (supervisor.errors; `status --help` lists them): 0 the daemon is
ready; 1 it could not be reached or answered with an error (one line on
stderr says which); 2 a bad --listen or config; 4 it answered but is not
ready (the placement is still printed, with the reasons).

The `reload` command: SIGHUP to the daemon the API names (or `--pid`), then
GET /placement until its `config.last_reload` is newer than the signal; prints
the verdict. Exit codes: 0 applied, 1 no daemon or no verdict in time, 2
invalid, 5 refused (needs a restart).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from supervisor.config import DEFAULT_LISTEN, load_config
from supervisor.cpulist import format_cpulist
from supervisor.errors import (
    EXIT_CONFIG,
    EXIT_NOT_READY,
    EXIT_OK,
    EXIT_RELOAD_REFUSED,
    EXIT_UNREACHABLE,
    ConfigError,
    SupervisorError,
)
from supervisor.listen import Listen, parse_listen

TIMEOUT_S = 5.0


class _UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over an AF_UNIX stream socket (unix(7))."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def http_request(
    where: Listen,
    method: str,
    path: str,
    *,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    timeout_s: float = TIMEOUT_S,
) -> tuple[int, dict[str, str], bytes]:
    """One request to the daemon's API: (status, headers, body). Raises OSError."""
    conn: http.client.HTTPConnection
    if where.path is not None:
        conn = _UnixHTTPConnection(where.path, timeout_s)
    else:
        conn = http.client.HTTPConnection(where.connect_host(), where.port, timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers=dict(headers or {}))
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    except http.client.HTTPException as err:
        raise OSError(f"bad HTTP answer: {err!r}") from None
    finally:
        conn.close()


def _where(args: Any) -> Listen:
    """--listen, else the config's API address (when the CLI passes --config), else the default."""
    listen: str | None = getattr(args, "listen", None)
    if listen is not None:
        return parse_listen(listen, "--listen")
    config_path: str | None = getattr(args, "config", None)
    if config_path is not None:
        api = load_config(config_path).api
        # The unix socket, when configured, works even with TCP bound elsewhere.
        if api.unix_socket is not None:
            return Listen(path=api.unix_socket)
        return api.listen
    return parse_listen(DEFAULT_LISTEN)


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _state(entry: Mapping[str, Any]) -> str:
    state = str(entry.get("state", "?"))
    loading = entry.get("loading") or {}
    if loading:  # the engine's probe waits: how long, of how long
        return f"loading({loading.get('elapsed_s', 0):.0f}s/{loading.get('timeout_s', 0):g}s)"
    backoff = entry.get("backoff") or {}
    if state == "backoff" and backoff.get("seconds"):
        return f"backoff({backoff['seconds']:g}s)"
    if state in ("failed", "stopped") and entry.get("exit_code") is not None:
        return f"{state}(exit {entry['exit_code']})"
    if state == "running" and not entry.get("bound", True):
        return "running(unbound)"
    since = entry.get("down_since")
    if state in ("starting", "waiting", "stopping") and isinstance(since, int | float):
        return f"{state}({max(0.0, time.time() - since):.0f}s)"  # how long so far
    return state


def _roles(entry: Mapping[str, Any]) -> str:
    roles: Mapping[str, Sequence[int]] = entry.get("roles") or {}
    if not roles:
        return format_cpulist(entry.get("cpus", ()))
    # main first, then the rest by name: the order a person expects to read.
    names = sorted(roles, key=lambda n: (n != "main", n))
    return " ".join(f"{n}={format_cpulist(roles[n])}" for n in names)


def _irqs(entry: Mapping[str, Any]) -> str:
    """The rank's planned IRQs as a list ("120-127"), and how many the check found
    delivered elsewhere ("120-127 (2 off plan)")."""
    planned = [a["irq"] for a in entry.get("irqs") or ()]
    if not planned:
        return "-"
    seen = (entry.get("observed") or {}).get("irqs") or ()
    off = sum(1 for i in seen if sorted(i.get("cpus") or ()) != sorted(i.get("planned") or ()))
    return format_cpulist(planned) + (f" ({off} off plan)" if off else "")


def _row(label: str, entry: Mapping[str, Any], irqs: bool = False) -> list[str]:
    device = entry.get("device") or {}
    observed = entry.get("observed") or {}
    ratio = observed.get("local_memory_ratio")
    return [
        label,
        _cell(entry.get("pid")),
        _state(entry),
        f"{device['kind']}{device['index']}" if device else "-",
        _cell(device.get("bus_id")),
        _cell(device.get("numa_node")),
        _cell(format_cpulist(entry.get("mems", ()))),
        _roles(entry),
        "-" if ratio is None else f"{100.0 * ratio:.1f}%",
        str(len(entry.get("drift") or ())),
        _cell(entry.get("restarts", 0)),
        *([_irqs(entry)] if irqs else []),
    ]


HEADER = [
    "RANK",
    "PID",
    "STATE",
    "DEVICE",
    "BUS",
    "NODE",
    "MEMS",
    "CPUS",
    "LOCAL",
    "DRIFT",
    "RESTARTS",
]


def render_status(doc: Mapping[str, Any], where: str = "") -> str:
    """The /placement document as a table a person reads at a glance (pure)."""
    sup = doc.get("supervisor") or {}
    rows: list[list[str]] = []
    labelled: list[tuple[str, Mapping[str, Any]]] = []
    if doc.get("engine"):
        labelled.append(("engine", doc["engine"]))
    labelled.extend((str(r["rank"]), r) for r in doc.get("ranks", ()))
    # An IRQS column where the plan binds IRQs (docs/planning.md, [irq]).
    irqs = any(entry.get("irqs") for _, entry in labelled)
    header = [*HEADER, *(["IRQS"] if irqs else [])]
    rows = [_row(label, entry, irqs) for label, entry in labelled]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    ready = sup.get("ready")
    head = (
        f"placement-supervisor {sup.get('version', '?')}"
        + (f" at {where}" if where else "")
        + f": strategy {doc.get('strategy', '?')}, accelerator {sup.get('accelerator', '?')}, "
        + ("ready" if ready else "NOT READY" if ready is False else "readiness unknown")
    )
    out = [head, line(header), *(line(r) for r in rows)]
    for reason in sup.get("not_ready") or ():
        out.append(f"not ready: {reason}")
    out += _config_lines(doc.get("config") or {})
    for label, entry in labelled:
        for f in entry.get("drift") or ():
            out.append(
                f"drift {label}: {f.get('kind')} {f.get('target')}: expected "
                f"{f.get('expected')}, actual {f.get('actual')} (action {f.get('action')})"
            )
    for warning in doc.get("warnings") or ():
        out.append(f"warning: {warning}")
    return "\n".join(out) + "\n"


def _config_lines(config: Mapping[str, Any]) -> list[str]:
    """What the table says of the config file: a reload that did not apply, and a
    file on disk that is not the one in force (pure)."""
    out: list[str] = []
    last = config.get("last_reload") or {}
    if last.get("result") not in (None, "ok"):
        out.append(f"config: last reload {last['result']}: {last.get('error')}")
    if config.get("in_force") and config.get("on_disk") != config.get("in_force"):
        out.append(
            "config: the file on disk is not the one in force"
            + (" (unreadable)" if config.get("on_disk") is None else " (reload it)")
        )
    return out


# After "cannot reach the daemon" when neither --listen nor --config said where.
NO_DAEMON_HINT = (
    " (no --listen or --config given: the default address was asked; give the daemon's "
    "config with --config FILE, or --listen HOST:PORT|unix:PATH)"
)


def status_command(args: Any) -> int:
    """`placement-supervisor status [--listen ADDR] [--json] [--watch [S]]`; returns the
    exit code (0 ready, 1 unreachable, 2 bad address or config, 4 not ready).

    Reads `args.listen` (None: the config's api address when `args.config` is
    set, else 127.0.0.1:9477) and `args.json` (print the raw document). With
    `args.watch` (seconds), prints it again every so often until interrupted.
    """
    try:
        where = _where(args)
    except SupervisorError as err:
        print(f"placement-supervisor status: {err}", file=sys.stderr)
        return err.exit_code if isinstance(err, ConfigError) else EXIT_UNREACHABLE
    interval_s: float | None = getattr(args, "watch", None)
    if interval_s is None:
        return _status_once(args, where)
    tty = sys.stdout.isatty()
    while True:  # Ctrl-C ends it (cli.main: 130)
        # A terminal is redrawn in place (as watch(1) does); a pipe gets one frame after another.
        sys.stdout.write("\x1b[H\x1b[2J" if tty else "")
        sys.stdout.write(f"every {interval_s:g}s: {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        _status_once(args, where)
        sys.stdout.write("\n")
        sys.stdout.flush()
        time.sleep(interval_s)


def _status_once(args: Any, where: Listen) -> int:
    """One GET /placement, printed; the exit code `status` would give."""
    try:
        code, _, body = http_request(where, "GET", "/placement")
    except OSError as err:
        why = err.strerror or str(err)
        hint = (
            NO_DAEMON_HINT
            if getattr(args, "listen", None) is None and getattr(args, "config", None) is None
            else ""
        )
        print(
            f"placement-supervisor status: cannot reach the daemon at {where}: {why}{hint}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_UNREACHABLE
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if code != 200 or not isinstance(doc, dict):
        message = doc.get("error") if isinstance(doc, dict) else body[:200].decode(errors="replace")
        print(f"placement-supervisor status: {where} answered {code}: {message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(render_status(doc, str(where)))
    return status_exit_code(doc)


def status_exit_code(doc: Mapping[str, Any]) -> int:
    """0 when the document says the daemon is ready, else EXIT_NOT_READY (pure).

    A document that does not say (no `supervisor.ready`) is not ready: 0 must
    mean "ready" and nothing else to whoever scripts on it.
    """
    sup = doc.get("supervisor") or {}
    return EXIT_OK if sup.get("ready") is True else EXIT_NOT_READY


# -- reload -------------------------------------------------------------------------------

RELOAD_EXIT = {"ok": EXIT_OK, "invalid": EXIT_CONFIG, "refused": EXIT_RELOAD_REFUSED}


def _reload_where(args: Any) -> Listen:
    """Where the daemon listens for `reload`: --listen, else the config file's [api]
    read leniently (the file is what is being reloaded: a key error elsewhere in it
    must not hide the address), else the default."""
    if getattr(args, "listen", None) is not None or getattr(args, "config", None) is None:
        return _where(args)
    try:
        with open(args.config, "rb") as f:
            api = tomllib.load(f).get("api") or {}
        if isinstance(api.get("unix_socket"), str):
            return Listen(path=api["unix_socket"])
        return parse_listen(str(api.get("listen", DEFAULT_LISTEN)), "api.listen")
    except (OSError, ValueError, SupervisorError):
        return parse_listen(DEFAULT_LISTEN)


def _placement(where: Listen) -> dict[str, Any]:
    code, _, body = http_request(where, "GET", "/placement")
    doc = json.loads(body) if code == 200 else None
    if not isinstance(doc, dict):
        raise OSError(f"{where} answered {code}")
    return doc


def _last_reload(doc: Mapping[str, Any]) -> Mapping[str, Any] | None:
    last = (doc.get("config") or {}).get("last_reload")
    return last if isinstance(last, dict) else None


def reload_command(args: Any) -> int:
    """`placement-supervisor reload [--config FILE | --listen ADDR] [--pid PID]`:
    SIGHUP, wait for the verdict, print it: "applied", "refused: why", "invalid:
    file: key: why"; returns the exit code (RELOAD_EXIT, 1 when none came)."""
    where = _reload_where(args)
    name = "placement-supervisor reload"
    try:
        doc = _placement(where)
    except (OSError, ValueError) as err:
        print(f"{name}: cannot reach the daemon at {where}: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    pid = (doc.get("supervisor") or {}).get("pid")
    if args.pid is not None and pid is not None and args.pid != pid:
        print(f"{name}: {where} is the daemon of pid {pid}, not {args.pid}", file=sys.stderr)
        return EXIT_UNREACHABLE
    pid = args.pid if args.pid is not None else pid
    if not isinstance(pid, int):
        print(f"{name}: {where} does not say its pid; give --pid", file=sys.stderr)
        return EXIT_UNREACHABLE
    sent_at = time.time()
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as err:
        print(f"{name}: cannot signal pid {pid}: {err.strerror}", file=sys.stderr)
        return EXIT_UNREACHABLE
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            last = _last_reload(_placement(where))
        except (OSError, ValueError):
            continue  # the API may be busy with the reload itself
        if last is not None and float(last.get("at") or 0) >= sent_at:
            result = str(last.get("result"))
            print("applied" if result == "ok" else f"{result}: {last.get('error')}")
            return RELOAD_EXIT.get(result, EXIT_UNREACHABLE)
    print(f"{name}: no reload verdict from pid {pid} within {args.timeout:g}s", file=sys.stderr)
    return EXIT_UNREACHABLE
