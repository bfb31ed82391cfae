"""The HTTP API of DESIGN 3.4 (aiohttp) in the daemon's event loop (does I/O: sockets).

Handlers read `store.snapshot` only (never /proc) and render it through the
pure `*_doc` functions below; a rendered body is cached per snapshot object,
which is sound because a snapshot is immutable and every change publishes a
new one. I/O: the listening sockets, and the token file read once in `start()`.
Changing calls (`POST /rebind`, `POST /ranks/{rank}/restart`) go to an
`Actions` object that the daemon supplies.
"""

from __future__ import annotations

import dataclasses
import errno
import hmac
import importlib
import json
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from supervisor import __version__
from supervisor.config import ApiConfig
from supervisor.errors import ConfigError, SupervisorError
from supervisor.plan.placement import Placement, RankPlacement, Slot
from supervisor.serve.listen import Listen, parse_listen
from supervisor.serve.metrics import build_registry, collected_parts, not_ready_reasons
from supervisor.state import (
    EVENTS_KEPT,
    Observation,
    ProcessStatus,
    ProcKey,
    Snapshot,
    StateStore,
)
from supervisor.topology.model import Topology

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024  # changing calls take no body; anything big is a mistake
DEFAULT_STALE_AFTER_S = 30.0
EVENTS_DEFAULT_LIMIT = 100
SOCKET_MODE = 0o600  # only the owner (root) may connect: such requests skip the token
_NUMBER_RE = re.compile(r"[0-9]{1,9}")  # int() also takes " 3", "+3", "1_0"


class Actions(Protocol):
    """What the changing calls do; the daemon implements it.

    Raise KeyError for an unknown rank (404) and a `SupervisorError` when the
    action cannot run now, e.g. while stopping (409, with its message).
    """

    async def rebind(self, rank: ProcKey | None) -> dict[str, Any]: ...

    async def restart(self, rank: ProcKey) -> dict[str, Any]: ...


class ListenError(SupervisorError):
    """The API cannot listen where it was asked to (port taken, bad path...)."""


class _ApiError(Exception):
    """An error answer a handler decided on: becomes `{"error", "status"}`."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


# -- documents (pure) -------------------------------------------------------


def _plain(value: Any) -> Any:
    """A JSON-ready copy of dataclasses, mappings, sets and tuples."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    # Event fields may hold anything a caller passed; never fail a response on it.
    plain = _plain(value)
    return plain if plain is not value else str(value)


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), default=_json_default).encode()


def observation_doc(obs: Observation | None) -> dict[str, Any]:
    """The `observed` object of a process (empty lists until the first check)."""
    obs = obs or Observation()
    return {
        "threads": [
            {"tid": t.tid, "name": t.name, "role": t.role, "cpus": list(t.cpus)}
            for t in obs.threads
        ],
        # JSON object keys are strings: node 1 is "1".
        "memory_bytes_by_node": {str(n): b for n, b in sorted(obs.memory_bytes_by_node.items())},
        "local_memory_ratio": obs.local_memory_ratio,
        "irqs": [
            {"irq": i.irq, "cpus": list(i.cpus), "planned": list(i.planned)} for i in obs.irqs
        ],
        "observed_at": obs.observed_at or None,
    }


def process_doc(snap: Snapshot, key: ProcKey) -> dict[str, Any]:
    """What /placement adds to the plan entry of one process."""
    status = snap.processes.get(key) or ProcessStatus(key)
    return {
        "pid": status.pid,
        "state": status.state,
        "bound": status.bound,
        "restarts": status.restarts,
        "exit_code": status.exit_code,
        "backoff": {"seconds": status.backoff_s, "next_start_at": status.next_start_at},
        "mempolicy": {"step": status.mempolicy, "reason": status.mempolicy_reason},
        "cgroup": status.cgroup,
        "adopted": status.adopted,
        "ppid": status.ppid,
        "children": [m.to_doc() for m in snap.trees.get(key, ())],
        "observed": observation_doc(snap.observed.get(key)),
        "drift": [f.to_doc() for f in snap.drift.get(key, ())],
    }


def placement_doc(snap: Snapshot) -> dict[str, Any]:
    """GET /placement: the plan document (DESIGN 3.3) with live state per process."""
    doc = snap.placement.to_doc()
    if doc["engine"] is not None:
        doc["engine"].update(process_doc(snap, "engine"))
    for entry in doc["ranks"]:
        entry.update(process_doc(snap, entry["rank"]))
    doc["supervisor"] = supervisor_doc(snap)
    return doc


def supervisor_doc(snap: Snapshot) -> dict[str, Any]:
    """The `supervisor` object of /placement: the daemon itself."""
    reasons = not_ready_reasons(snap)
    return {
        "version": __version__,
        "accelerator": snap.accelerator_kind,
        "config": snap.config_path,
        "started_at": snap.started_at,
        "stopping": snap.stopping,
        "ready": not reasons,
        "not_ready": reasons,
        "last_check_at": snap.counters.last_check_at or None,
        "checks": snap.counters.checks,
        "cpuset_changes": snap.counters.cpuset_changes,
    }


class PlacementRenderer:
    """Renders GET /placement as `_dumps(placement_doc(snap))` would, reusing each
    process's JSON while its plan entry, status, observation and findings are
    the same objects.

    Most snapshots change one thing (a counter, an event, one rank's state); a
    16 x 100-thread body is 130 KiB, and rendering all of it on the event loop
    for every new snapshot stalled every request in flight.
    """

    def __init__(self) -> None:
        self._parts: dict[ProcKey, tuple[tuple[object, ...], bytes]] = {}
        self._frame: tuple[object, bytes, bytes] | None = None  # placement, head, tail

    def _process(self, snap: Snapshot, key: ProcKey, planned: Slot | RankPlacement) -> bytes:
        identity = (
            planned,
            snap.processes.get(key),
            snap.observed.get(key),
            snap.drift.get(key),
            snap.trees.get(key),
        )
        hit = self._parts.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], identity, strict=True)):
            return hit[1]
        doc = planned.to_doc()
        doc.update(process_doc(snap, key))
        body = _dumps(doc)
        self._parts[key] = (identity, body)  # holding the objects keeps `is` sound
        return body

    def _head_and_tail(self, placement: Placement) -> tuple[bytes, bytes]:
        """The plan document's own keys around "engine" and "ranks", from
        Placement.to_doc() itself (once per placement: it changes on a re-plan)."""
        if self._frame is None or self._frame[0] is not placement:
            doc = placement.to_doc()
            keys = list(doc)
            at = keys.index("engine")
            assert keys[at : at + 2] == ["engine", "ranks"], keys
            head = _dumps({k: doc[k] for k in keys[:at]})[1:-1]
            tail = _dumps({k: doc[k] for k in keys[at + 2 :]})[1:-1]
            # `{head,"engine":..,"ranks":[..],tail,"supervisor":..}`
            self._frame = (placement, b"{" + head + b"," * bool(head), b"," * bool(tail) + tail)
        return self._frame[1], self._frame[2]

    def render(self, snap: Snapshot) -> bytes:
        placement = snap.placement
        engine = b"null"
        if placement.engine is not None:
            engine = self._process(snap, "engine", placement.engine)
        ranks = [self._process(snap, r.rank, r) for r in placement.ranks]
        head, tail = self._head_and_tail(placement)
        return b"".join(
            (
                head,
                b'"engine":',
                engine,
                b',"ranks":[',
                b",".join(ranks),
                b"]",
                tail,
                b',"supervisor":',
                _dumps(supervisor_doc(snap)),
                b"}",
            )
        )


def _topology_renderer() -> Callable[[Topology], Any]:
    # supervisor.topology.render (the `topology --json` document) when it exists;
    # otherwise a plain field-by-field copy of the dataclasses.
    try:
        module = importlib.import_module("supervisor.topology.render")
    except ImportError:
        return _plain
    render: Callable[[Topology], Any] = getattr(module, "topology_to_doc", _plain)
    return render


def events_doc(snap: Snapshot, since: int | None, limit: int) -> dict[str, Any]:
    """GET /events: with `since`, the oldest `limit` events after it; else the newest.

    `latest_seq` is the number to pass as the next `since`; a `since` above it
    means the daemon restarted (sequence numbers start again at 1).
    """
    events = snap.events
    newer = events if since is None else tuple(e for e in events if e.seq > since)
    chosen = newer[-limit:] if since is None else newer[:limit]
    latest = events[-1].seq if events else 0
    return {
        "events": [e.to_doc() for e in chosen],
        "latest_seq": latest,
        "oldest_seq": events[0].seq if events else 0,
        "next_since": chosen[-1].seq if chosen else (latest if since is None else since),
        "started_at": snap.started_at,
    }


# -- routes and their OpenAPI description ------------------------------------


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    where: str  # "query" or "path"
    description: str
    required: bool = False


@dataclass(frozen=True, slots=True)
class Route:
    """One route: the router and /openapi.json are both built from ROUTES."""

    method: str
    path: str
    handler: str  # ApiServer method name
    summary: str
    changing: bool = False
    params: tuple[Param, ...] = ()
    responses: Mapping[int, str] = field(default_factory=dict)
    content_type: str = "application/json"


_RANK_QUERY = Param("rank", "query", "A rank number or engine; without it, every process.")
ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/placement",
        "_get_placement",
        "The plan document with pid, state, observed placement and drift per process.",
        responses={200: "the placement document"},
    ),
    Route("GET", "/topology", "_get_topology", "The discovered host topology."),
    Route(
        "GET",
        "/healthz",
        "_get_healthz",
        "The supervisor's loop is alive: the last placement check is recent.",
        responses={200: "alive", 503: "no check finished recently"},
    ),
    Route(
        "GET",
        "/readyz",
        "_get_readyz",
        "Every process is running and bound as planned.",
        responses={200: "ready", 503: "not ready, with the reasons"},
    ),
    Route(
        "GET",
        "/metrics",
        "_get_metrics",
        "Prometheus metrics (text format; OpenMetrics when the Accept header asks).",
        content_type="text/plain",
    ),
    Route(
        "GET",
        "/events",
        "_get_events",
        "Recent bind, drift and restart events.",
        params=(
            Param("since", "query", "Only events with a sequence number above this."),
            Param("limit", "query", f"At most this many events (1-{EVENTS_KEPT}, default 100)."),
        ),
        responses={200: "events", 400: "bad since or limit"},
    ),
    Route("GET", "/openapi.json", "_get_openapi", "This description of the API."),
    Route(
        "POST",
        "/rebind",
        "_post_rebind",
        "Apply the plan again to every process, or to one rank.",
        changing=True,
        params=(_RANK_QUERY,),
        responses={200: "what was re-bound", 400: "bad rank", 404: "unknown rank"},
    ),
    Route(
        "POST",
        "/ranks/{rank}/restart",
        "_post_restart",
        "Restart one rank's worker.",
        changing=True,
        params=(Param("rank", "path", "The rank number, or engine.", required=True),),
        responses={200: "the restart was started", 400: "bad rank", 404: "unknown rank"},
    ),
)


def openapi_doc(routes: tuple[Route, ...] = ROUTES) -> dict[str, Any]:
    """An OpenAPI 3.0 description of `routes` (served at /openapi.json)."""
    error_ref = {"$ref": "#/components/schemas/Error"}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        common = {
            401: "no or bad bearer token",
            403: "changing calls over TCP need api.token_file",
            409: "the action cannot run now",
            413: f"request body over {MAX_BODY_BYTES} bytes",
        }
        responses: dict[str, Any] = {}
        for code, text in sorted({200: "ok", **route.responses}.items()):
            schema = error_ref if code >= 400 else {"type": "object"}
            ctype = route.content_type if code < 400 else "application/json"
            if ctype != "application/json":
                schema = {"type": "string"}
            responses[str(code)] = {"description": text, "content": {ctype: {"schema": schema}}}
        if route.changing:
            for code, text in common.items():
                responses[str(code)] = {
                    "description": text,
                    "content": {"application/json": {"schema": error_ref}},
                }
        op: dict[str, Any] = {
            "summary": route.summary,
            "operationId": route.handler.strip("_"),
            "responses": responses,
        }
        if route.params:
            op["parameters"] = [
                {
                    "name": p.name,
                    "in": p.where,
                    "description": p.description,
                    "required": p.required or p.where == "path",
                    "schema": {"type": "integer", "minimum": 0},
                }
                for p in route.params
            ]
        if route.changing:
            op["security"] = [{"bearer": []}, {}]
            op["description"] = (
                "Needs `Authorization: Bearer <token>` (the token in api.token_file) over TCP; "
                "over the unix socket (mode 0600) no token is needed."
            )
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.0.3",
        "info": {"title": "Placement Supervisor", "version": __version__},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error", "status"],
                    "properties": {
                        "error": {"type": "string"},
                        "status": {"type": "integer"},
                    },
                }
            },
        },
    }


# -- helpers for handlers ----------------------------------------------------


def _error_response(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=_dumps({"error": message, "status": status}),
        content_type="application/json",
        headers=headers,
    )


def _json_response(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_dumps(doc), content_type="application/json")


def _parse_rank(text: str | None, where: str) -> ProcKey:
    if text == "engine":
        return "engine"
    if text is None or not _NUMBER_RE.fullmatch(text):
        raise _ApiError(400, f"{where}: expected a rank number (0, 1, ...) or engine, got {text!r}")
    return int(text)


def _int_query(
    request: web.Request, name: str, default: int | None, lo: int, hi: int
) -> int | None:
    text = request.query.get(name)
    if text is None:
        return default
    if not _NUMBER_RE.fullmatch(text) or not lo <= int(text) <= hi:
        raise _ApiError(400, f"?{name}: expected an integer {lo}-{hi}, got {text!r}")
    return int(text)


def _via_unix(request: web.Request) -> bool:
    transport = request.transport
    sock = None if transport is None else transport.get_extra_info("socket")
    return sock is not None and sock.family == socket.AF_UNIX


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no such route: {request.method} {request.path} (see /openapi.json)"
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        return f"method {request.method} not allowed on {request.path}; allowed: {allowed}"
    if exc.status == 413:
        return f"request body larger than {MAX_BODY_BYTES} bytes"
    return exc.reason


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error is `{"error": ..., "status": N}`; a 500 never shows a traceback."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        return _error_response(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    try:
        return await handler(request)
    except _ApiError as err:
        return _error_response(err.status, err.message, err.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        keep = {k: v for k, v in exc.headers.items() if k in ("Allow", "WWW-Authenticate")}
        return _error_response(exc.status, _http_message(request, exc), keep)
    except Exception:
        log.exception(
            "api handler failed method=%s path=%s action=respond_500",
            request.method,
            request.path,
        )
        return _error_response(500, "internal error (logged by the supervisor)")


# -- the server ---------------------------------------------------------------


def _read_token(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            token = f.read().strip()
    except OSError as err:
        raise ConfigError(f"{path}: api.token_file: cannot read: {err.strerror or err}") from None
    if not token:
        raise ConfigError(f"{path}: api.token_file: the file is empty")
    return token


def _format_sockname(name: Any) -> str:
    if isinstance(name, (str, bytes)):
        return f"unix:{os.fsdecode(name)}"
    return str(Listen(host=str(name[0]), port=int(name[1])))


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file a dead daemon left; refuse a live one or a non-socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ListenError(f"unix:{path}: exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as err:
        if err.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
    else:
        raise ListenError(f"unix:{path}: already in use (another supervisor running?)")
    finally:
        probe.close()
    os.unlink(path)


def _bind_unix(path: str) -> socket.socket:
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # Set the mode between bind(2) and listen(2): until listen() every
        # connect() is refused (unix(7)), so there is no moment at which the
        # socket accepts clients with the umask's mode.
        os.chmod(path, SOCKET_MODE)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class ApiServer:
    """The aiohttp app and its sites; the daemon calls `start()` and `stop()`."""

    def __init__(
        self,
        store: StateStore,
        actions: Actions,
        config: ApiConfig,
        listen: str | None = None,
        *,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        registry: CollectorRegistry | None = None,
        cache: bool = True,
    ) -> None:
        where = "--listen" if listen is not None else "api.listen"
        self._listen = parse_listen(listen if listen is not None else config.listen, where)
        self._store = store
        self._actions = actions
        self._config = config
        self._stale_after_s = stale_after_s
        # Caching /metrics per snapshot is sound only when the registry renders
        # nothing but the snapshot, i.e. when it is ours.
        self._metrics_cacheable = cache and registry is None
        self._cache_enabled = cache
        self.registry = registry if registry is not None else build_registry(store)
        self._render_topology = _topology_renderer()
        self._token: bytes | None = None
        self._runner: web.AppRunner | None = None
        self._unix_paths: list[str] = []
        self._started_at = time.time()
        self._cache: dict[str, tuple[tuple[object, ...], bytes]] = {}
        self._placement = PlacementRenderer()
        self._openapi = _dumps(openapi_doc())
        self.addresses: tuple[str, ...] = ()
        self.app = self._make_app()

    def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[_json_errors], client_max_size=MAX_BODY_BYTES)
        for route in ROUTES:
            app.router.add_route(route.method, route.path, getattr(self, route.handler))
        return app

    async def start(self) -> None:
        """Listen; raises ListenError (port taken...) or ConfigError (token file)."""
        if self._config.token_file is not None:
            self._token = _read_token(self._config.token_file)
        runner = web.AppRunner(
            self.app, handle_signals=False, access_log=None, shutdown_timeout=2.0
        )
        await runner.setup()
        try:
            await self._add_site(runner, self._listen)
            if self._config.unix_socket is not None:
                await self._add_site(runner, Listen(path=self._config.unix_socket))
        except BaseException:
            await runner.cleanup()
            self._unlink_sockets()
            raise
        self._runner = runner
        self._started_at = time.time()
        self.addresses = tuple(_format_sockname(name) for name in runner.addresses)
        log.info(
            "api listening addresses=%s token=%s action=serve",
            ",".join(self.addresses),
            "file" if self._token is not None else "none",
        )

    async def _add_site(self, runner: web.AppRunner, where: Listen) -> None:
        site: web.BaseSite
        try:
            if where.path is not None:
                sock = _bind_unix(where.path)
                self._unix_paths.append(where.path)
                site = web.SockSite(runner, sock)
            else:
                site = web.TCPSite(runner, where.host, where.port)
            await site.start()
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                why = "address already in use (another supervisor running?)"
            else:
                why = err.strerror or str(err)
            raise ListenError(f"api cannot listen on {where}: {why}") from None

    async def stop(self) -> None:
        """Close the sites (in-flight requests get a short grace) and remove sockets."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self._unlink_sockets()
        self.addresses = ()

    def _unlink_sockets(self) -> None:
        for path in self._unix_paths:
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass
        self._unix_paths = []

    # -- rendering with a per-snapshot cache ------------------------------

    def _rendered(
        self, name: str, identity: tuple[object, ...], render: Callable[[], bytes]
    ) -> bytes:
        """`render()`, or the body rendered last time for the same objects (`is`)."""
        if not self._cache_enabled:
            return render()
        hit = self._cache.get(name)
        if hit is not None and all(a is b for a, b in zip(hit[0], identity, strict=True)):
            return hit[1]
        body = render()
        # Holding `identity` keeps it alive, so `is` can never match a new
        # object at a recycled address.
        self._cache[name] = (identity, body)
        return body

    # -- read-only routes ---------------------------------------------------

    async def _get_placement(self, request: web.Request) -> web.Response:
        snap = self._store.snapshot
        if self._cache_enabled:
            body = self._rendered("placement", (snap,), lambda: self._placement.render(snap))
        else:
            body = _dumps(placement_doc(snap))
        return web.Response(body=body, content_type="application/json")

    async def _get_topology(self, request: web.Request) -> web.Response:
        topo = self._store.snapshot.topology
        body = self._rendered("topology", (topo,), lambda: _dumps(self._render_topology(topo)))
        return web.Response(body=body, content_type="application/json")

    async def _get_healthz(self, request: web.Request) -> web.Response:
        snap = self._store.snapshot
        counters = snap.counters
        since = counters.last_check_at or snap.started_at or self._started_at
        age_s = max(0.0, time.time() - since)
        doc: dict[str, Any] = {
            "status": 200,
            "checks": counters.checks,
            "last_check_at": counters.last_check_at or None,
            "last_check_age_s": round(age_s, 3),
            "stale_after_s": self._stale_after_s,
        }
        if age_s > self._stale_after_s:
            doc["status"] = 503
            doc["error"] = (
                f"no placement check finished for {age_s:.1f} s"
                if counters.checks
                else f"no placement check finished yet, {age_s:.1f} s after start"
            ) + f" (limit {self._stale_after_s:g} s)"
            return _json_response(doc, 503)
        return _json_response(doc)

    async def _get_readyz(self, request: web.Request) -> web.Response:
        reasons = not_ready_reasons(self._store.snapshot)
        if reasons:
            doc = {"status": 503, "error": "not ready: " + "; ".join(reasons), "reasons": reasons}
            return _json_response(doc, 503)
        return _json_response({"status": 200, "ready": True})

    async def _get_metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        snap = self._store.snapshot
        if self._metrics_cacheable:
            parts = collected_parts(snap)
            body = self._rendered("metrics " + content_type, parts, lambda: encoder(self.registry))
        else:
            body = encoder(self.registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _get_events(self, request: web.Request) -> web.Response:
        since = _int_query(request, "since", None, 0, 999_999_999)
        limit = _int_query(request, "limit", EVENTS_DEFAULT_LIMIT, 1, EVENTS_KEPT)
        assert limit is not None
        return _json_response(events_doc(self._store.snapshot, since, limit))

    async def _get_openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    # -- changing routes ----------------------------------------------------

    def _authorize(self, request: web.Request) -> str:
        """How the caller is trusted ("unix" or "token"); raises 401/403 otherwise."""
        if _via_unix(request):
            return "unix"  # the socket is mode 0600: the filesystem already checked
        if self._token is None:
            raise _ApiError(
                403,
                "changing calls over TCP are refused: no api.token_file is configured "
                "(set one, or use the unix socket api.unix_socket)",
            )
        challenge = {"WWW-Authenticate": 'Bearer realm="placement-supervisor"'}
        header = request.headers.get("Authorization")
        if header is None:
            raise _ApiError(401, "missing header Authorization: Bearer <token>", challenge)
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise _ApiError(401, "expected Authorization: Bearer <token>", challenge)
        if not hmac.compare_digest(value.strip().encode("utf-8", "replace"), self._token):
            raise _ApiError(401, "bad bearer token", challenge)
        return "token"

    async def _changing(
        self,
        request: web.Request,
        what: str,
        rank_text: str | None,
        action: Callable[[ProcKey | None], Awaitable[dict[str, Any]]],
    ) -> web.Response:
        via = self._authorize(request)  # before anything else is looked at
        rank = None if rank_text is None else _parse_rank(rank_text, "rank")
        await request.read()  # enforces client_max_size on a chunked body (413)
        try:
            result = await action(rank)
        except KeyError:
            raise _ApiError(404, f"no rank {rank} in the plan") from None
        except SupervisorError as err:
            raise _ApiError(409, f"{what} refused: {err}") from None
        log.info(
            "api %s rank=%s via=%s action=%s",
            what,
            "all" if rank is None else rank,
            via,
            what,
        )
        return _json_response(result)

    async def _post_rebind(self, request: web.Request) -> web.Response:
        return await self._changing(
            request, "rebind", request.query.get("rank"), self._actions.rebind
        )

    async def _post_restart(self, request: web.Request) -> web.Response:
        async def restart(rank: ProcKey | None) -> dict[str, Any]:
            assert rank is not None  # the route always has one
            return await self._actions.restart(rank)

        return await self._changing(request, "restart", request.match_info["rank"], restart)


__all__ = [
    "ROUTES",
    "Actions",
    "ApiServer",
    "ListenError",
    "PlacementRenderer",
    "events_doc",
    "openapi_doc",
    "placement_doc",
]
