"""The API server: the aiohttp app over the route table, sockets, who may change things (does I/O).

I/O: the listening TCP and unix sockets (the socket file is made mode 0600
before listen(2)), the token file read in `start()` (and at each reload), and the
self-usage sampler task (supervisor.serve.usage). aiohttp runs under
`AppRunner(handle_signals=False)`: the daemon owns the signals. A changing
route is reached only over the unix socket or with the bearer token.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hmac
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from supervisor.bind.fdlimit import current_soft_limit, plan_fd_budget
from supervisor.config import ApiConfig, read_token_file
from supervisor.errors import SupervisorError
from supervisor.listen import Listen, parse_listen
from supervisor.serve.guard import ConnectionGuard, GuardedSite, Limits
from supervisor.serve.metrics import build_collector, build_registry
from supervisor.serve.openapi import MAX_BODY_BYTES, Handler, Route
from supervisor.serve.peer import UnixPolicy, peer_of
from supervisor.serve.routes import (
    DEFAULT_STALE_AFTER_S,
    Actions,
    ApiError,
    Handlers,
    error_response,
)
from supervisor.serve.usage import SELF_USAGE_INTERVAL_S, self_usage_loop
from supervisor.state import StateStore

log = logging.getLogger(__name__)

SOCKET_MODE = 0o600  # only the owner may connect; changing calls check the peer too (serve/peer.py)


class ListenError(SupervisorError):
    """The API cannot listen where it was asked to (port taken, bad path...)."""


# -- errors as JSON ------------------------------------------------------------------


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no such route: {request.method} {request.path} (see /openapi.json)"
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        return f"method {request.method} not allowed on {request.path}; allowed: {allowed}"
    if exc.status == 413:
        return f"request body larger than {MAX_BODY_BYTES} bytes"
    return exc.reason


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error is `{"error": ..., "status": N}`; a 500 never shows a traceback."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        return error_response(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err.status, err.message, err.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        keep = {k: v for k, v in exc.headers.items() if k in ("Allow", "WWW-Authenticate")}
        return error_response(exc.status, _http_message(request, exc), keep)
    except Exception:
        log.exception(
            "api handler failed method=%s path=%s action=respond_500",
            request.method,
            request.path,
        )
        return error_response(500, "internal error (logged by the supervisor)")


# -- who may change things -------------------------------------------------------------


def _read_token(path: str) -> bytes:
    return read_token_file(path)  # regular, capped, private (supervisor.config)


def _unix_socket(request: web.Request) -> socket.socket | None:
    transport = request.transport
    sock = None if transport is None else transport.get_extra_info("socket")
    return sock if sock is not None and sock.family == socket.AF_UNIX else None


def authorize(request: web.Request, token: bytes | None, unix: UnixPolicy | None = None) -> str:
    """How the caller is trusted ("unix" or "token"); raises 401/403 otherwise.

    Over the unix socket, the peer's credentials as the kernel recorded them
    (SO_PEERCRED), not the socket file's mode, which a chmod undoes."""
    sock = _unix_socket(request)
    if sock is not None:
        policy = unix if unix is not None else UnixPolicy.of(None)
        try:
            why = policy.refusal(peer_of(sock))
        except OSError as err:
            why = f"the unix socket's peer cannot be known: {err.strerror or err}"
        if why is not None:
            raise ApiError(403, why)
        return "unix"
    if token is None:
        raise ApiError(
            403,
            "changing calls over TCP are refused: no api.token_file is configured "
            "(set one, or use the unix socket api.unix_socket)",
        )
    challenge = {"WWW-Authenticate": 'Bearer realm="placement-supervisor"'}
    header = request.headers.get("Authorization")
    if header is None:
        raise ApiError(401, "missing header Authorization: Bearer <token>", challenge)
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise ApiError(401, "expected Authorization: Bearer <token>", challenge)
    if not hmac.compare_digest(value.strip().encode("utf-8", "replace"), token):
        raise ApiError(401, "bad bearer token", challenge)
    return "token"


# -- sockets ---------------------------------------------------------------------------


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


# -- the server --------------------------------------------------------------------------


class ApiServer:
    """The aiohttp app and its sites; the daemon calls `start()` and `stop()`.

    `registry` is the daemon's own metrics registry (one `SnapshotCollector`
    over `store`); `self_usage_interval_s=None` samples no self-usage.
    """

    def __init__(
        self,
        store: StateStore,
        actions: Actions,
        config: ApiConfig,
        listen: str | None = None,
        *,
        stale_after_s: float | Callable[[], float] = DEFAULT_STALE_AFTER_S,
        self_usage_interval_s: float | None = SELF_USAGE_INTERVAL_S,
    ) -> None:
        self._listen = config.listen if listen is None else parse_listen(listen, "--listen")
        self._store = store
        self._config = config
        self._self_usage_interval_s = self_usage_interval_s
        self.collector = build_collector(store)
        self.registry: CollectorRegistry = build_registry(store, self.collector)
        self.handlers = Handlers(store, actions, self.collector, stale_after_s=stale_after_s)
        self.routes: tuple[Route, ...] = self.handlers.routes
        self._token: bytes | None = None
        self._unix_policy: UnixPolicy | None = None
        self._runner: web.AppRunner | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._summary: asyncio.Task[None] | None = None
        # The cap counts against the process's fd limit as start() finds it.
        self.guard = ConnectionGuard(store, Limits.of(config))
        self._unix_paths: list[str] = []
        self.addresses: tuple[str, ...] = ()
        self.app = self._make_app()

    def _make_app(self) -> web.Application:
        app = web.Application(
            middlewares=[_json_errors, self.guard.middleware], client_max_size=MAX_BODY_BYTES
        )
        for route in self.routes:
            handler = self._guarded(route) if route.changing else route.handler
            app.router.add_route(route.method, route.path, handler)
        return app

    def _guarded(self, route: Route) -> Handler:
        """`route`'s handler, reached only by a trusted caller (checked before
        anything else is looked at), and logged with how it was trusted."""

        @functools.wraps(route.handler)
        async def guarded(request: web.Request) -> web.StreamResponse:
            via = authorize(request, self._token, self._unix_policy)
            response = await route.handler(request)
            log.info(
                "api call path=%s via=%s status=%d action=%s",
                request.path_qs,
                via,
                response.status,
                route.operation_id,
            )
            return response

        return guarded

    async def start(self) -> None:
        """Listen; raises ListenError (port taken...) or ConfigError (token file)."""
        if self._config.token_file is not None:
            self._token = _read_token(self._config.token_file)
        self._unix_policy = UnixPolicy.of(self._config.unix_socket_group)
        budget = plan_fd_budget(self._config.max_connections, current_soft_limit())
        self.guard.limits = Limits.of(self._config, budget.max_connections)
        if budget.lowered:
            log.warning(
                "api max_connections lowered asked=%d max_connections=%d reserve_fds=%d "
                "soft_limit=%d action=cap",
                self._config.max_connections,
                budget.max_connections,
                budget.reserve_fds,
                current_soft_limit(),
            )
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
        self.handlers.up_since = time.time()
        self.addresses = tuple(_format_sockname(name) for name in runner.addresses)
        if self._self_usage_interval_s is not None:
            self._sampler = asyncio.create_task(
                self_usage_loop(self._store, self._self_usage_interval_s), name="self_usage"
            )
        self._summary = asyncio.create_task(self.guard.summary_loop(), name="api_bad_requests")
        limits = self.guard.limits
        log.info(
            "api listening addresses=%s token=%s max_connections=%d header_timeout_s=%g "
            "body_timeout_s=%g idle_timeout_s=%g action=serve",
            ",".join(self.addresses),
            "file" if self._token is not None else "none",
            limits.max_connections,
            limits.header_timeout_s,
            limits.body_timeout_s,
            limits.idle_timeout_s,
        )

    def use_token(self, token: bytes) -> None:
        """The bearer token from now on (a reload re-read api.token_file: a rotation)."""
        changed = not hmac.compare_digest(token, self._token or b"")
        self._token = token
        log.info("api token %s", "replaced" if changed else "unchanged")

    async def _add_site(self, runner: web.AppRunner, where: Listen) -> None:
        site: web.BaseSite
        try:
            if where.path is not None:
                sock = _bind_unix(where.path)
                self._unix_paths.append(where.path)
                site = GuardedSite(runner, self.guard, sock=sock)
            else:
                site = GuardedSite(runner, self.guard, host=where.host, port=where.port)
            await site.start()
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                why = "address already in use (another supervisor running?)"
            else:
                why = err.strerror or str(err)
            raise ListenError(f"api cannot listen on {where}: {why}") from None

    async def stop(self) -> None:
        """Close the sites (in-flight requests get a short grace) and remove sockets."""
        for task in (self._sampler, self._summary):
            if task is not None:
                await _cancel(task)
        self._sampler = self._summary = None
        self.guard.flush()
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


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel and await a side task of the API; one that already died is logged, not raised:
    a sampler or summary that failed must not turn a clean stop into a traceback."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception as err:
        log.error("api task failed task=%s error=%r action=ignore", task.get_name(), err)
