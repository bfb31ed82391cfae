"""The API's connections: a cap, header/body/idle timeouts, JSON for bad requests (I/O: sockets).

aiohttp's `RequestHandler` (one per connection) answers a request its parser
refuses with a plain-text 400 and a traceback on `aiohttp.server`
(web_protocol.RequestHandler.handle_error): a flood of them floods the log.
`ApiProtocol` answers JSON instead (431 for a header over its limit), counts
it, and logs no line per request: `ConnectionGuard` writes the first of a
quiet spell at once and then one summary per interval. `GuardedSite` serves
a socket with `ApiProtocol`s, which keep the open connections under the cap
(the API never takes the descriptors that spawning and watching need,
supervisor.bind.fdlimit): at the cap a new connection takes the place of the
oldest one with no request in progress (idle between requests, or still
sending its headers), so idle connections never keep a liveness probe from
/healthz; while every one is in a request (a slow body), a reserve of
HEALTH_RESERVE more serves /healthz and /readyz only; past that, a 503.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from supervisor.config import ApiConfig
from supervisor.serve.openapi import Handler
from supervisor.serve.routes import error_response
from supervisor.state import HttpBadReason, StateStore

log = logging.getLogger(__name__)

Admission = Literal["any", "health"] | None

# aiohttp's own defaults (web_protocol.RequestHandler), named here because the
# 431 message quotes them: a header line, and how many header lines.
MAX_HEADER_LINE_BYTES = 8190
MAX_HEADERS = 128
LINGER_MAX_S = 10.0  # aiohttp's default lingering_time
BAD_REQUEST_LOG_INTERVAL_S = 60.0  # one summary line a minute, at most, however many
# Connections past the cap, for the probes alone: their requests are answered in
# microseconds, so they are shed like idle ones and a new probe always gets in.
HEALTH_RESERVE = 16
HEALTH_PATHS = frozenset(("/healthz", "/readyz"))

# Written before reading a byte of the request, then closed: the client learns
# why (RFC 9110 15.6.4) instead of seeing a bare reset.
_OVER_CAP_BODY = b'{"error": "too many connections to the API; retry later", "status": 503}\n'
OVER_CAP_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Content-Length: " + str(len(_OVER_CAP_BODY)).encode() + b"\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n\r\n" + _OVER_CAP_BODY
)


@dataclass(frozen=True, slots=True)
class Limits:
    """What every connection is held to (api.* of the config, the cap after the fd budget)."""

    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float

    @classmethod
    def of(cls, config: ApiConfig, max_connections: int | None = None) -> Limits:
        cap = config.max_connections if max_connections is None else max_connections
        return cls(cap, config.header_timeout_s, config.body_timeout_s, config.idle_timeout_s)


def classify_parse_error(exc: BaseException | None) -> tuple[int, HttpBadReason, str]:
    """The status, counter reason and JSON message for what aiohttp's parser raised (pure)."""
    if isinstance(exc, LineTooLong):
        return (
            431,
            "headers_too_large",
            f"request header fields too large: a line is over {MAX_HEADER_LINE_BYTES} bytes",
        )
    if isinstance(exc, BadHttpMessage) and "Too many headers" in exc.message:
        return 431, "headers_too_large", f"request header fields too large: over {MAX_HEADERS}"
    detail = exc.message if isinstance(exc, BadHttpMessage) else "the request cannot be parsed"
    # Only the parser's phrase (up to its first quote), never the bytes it quotes.
    return 400, "malformed", f"bad request: {detail.split(chr(39), 1)[0].strip(' :')}"


class ConnectionGuard:
    """State every connection shares: how many are open, what was refused, the log tally."""

    def __init__(self, store: StateStore, limits: Limits) -> None:
        self.store = store
        self.limits = limits
        # Open connections, oldest first (a dict keeps insertion order).
        self.open: dict[ApiProtocol, None] = {}
        self.shed = 0  # connections closed to make room for a new one, in all
        self._shed_pending = 0  # since the last summary
        self._pending: Counter[str] = Counter()  # bad requests since the last summary
        self._refused_pending = 0
        self._announced = False

    @property
    def open_connections(self) -> int:
        return len(self.open)

    def admit(self) -> Admission:
        """Room for a new connection: under the cap ("any"), else made by closing the
        oldest connection with no request in progress; else in the probes' reserve
        ("health"); else None (every connection, the reserve's too, is in a request)."""
        cap = self.limits.max_connections
        if len(self.open) >= cap:
            oldest = next((p for p in self.open if not p.in_request), None)
            if oldest is not None:
                oldest.shed()
                self.shed += 1
                self._shed_pending += 1
                c = self.store.snapshot.counters
                self.store.update(counters=replace(c, http_connections_shed=self.shed))
        if len(self.open) < cap:
            return "any"
        return "health" if len(self.open) < cap + HEALTH_RESERVE else None

    def bad_request(self, reason: HttpBadReason, status: int, peer: str) -> None:
        """Count one; log it only when it is the first since the last summary."""
        self.store.count("http_bad_requests", reason)
        self._pending[reason] += 1
        if not self._announced:
            self._announced = True
            log.warning(
                "api bad request reason=%s status=%d peer=%s action=respond; "
                "more are summed every %gs",
                reason,
                status,
                peer,
                BAD_REQUEST_LOG_INTERVAL_S,
            )

    def refused(self) -> None:
        c = self.store.snapshot.counters
        refused = c.http_connections_refused + 1
        self.store.update(counters=replace(c, http_connections_refused=refused))
        self._refused_pending += 1
        if not self._announced:
            self._announced = True
            log.warning(
                "api connection refused open=%d max_connections=%d action=respond_503; "
                "more are summed every %gs",
                self.open_connections,
                self.limits.max_connections,
                BAD_REQUEST_LOG_INTERVAL_S,
            )

    def flush(self) -> None:
        """The summary line of what came since the last one (nothing when nothing came)."""
        if self._pending or self._refused_pending or self._shed_pending:
            reasons = ",".join(f"{r}:{n}" for r, n in sorted(self._pending.items())) or "-"
            log.warning(
                "api bad requests count=%d reasons=%s connections_refused=%d "
                "connections_shed=%d open=%d max_connections=%d interval_s=%g action=respond",
                sum(self._pending.values()),
                reasons,
                self._refused_pending,
                self._shed_pending,
                self.open_connections,
                self.limits.max_connections,
                BAD_REQUEST_LOG_INTERVAL_S,
            )
        else:
            self._announced = False  # a quiet interval: the next one is logged at once
        self._pending.clear()
        self._refused_pending = self._shed_pending = 0

    async def summary_loop(self, interval_s: float = BAD_REQUEST_LOG_INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.flush()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Headers are in: stop the header clock; a connection of the probes' reserve
        asks for /healthz or /readyz or gets a 503; read any body within body_timeout_s."""
        protocol = request.protocol
        if isinstance(protocol, ApiProtocol):
            protocol.headers_received()
            if protocol.health_only and request.path not in HEALTH_PATHS:
                self.refused()
                response = error_response(
                    503,
                    "too many connections to the API: only /healthz and /readyz now; retry later",
                    {"Connection": "close", "Retry-After": "1"},
                )
                response.force_close()
                return response
        if request.body_exists:
            try:
                # read() keeps the body: the route's request.json() reads it again.
                await asyncio.wait_for(request.read(), self.limits.body_timeout_s)
            except TimeoutError:
                self.bad_request("body_timeout", 408, request.remote or "unix")
                response = error_response(
                    408,
                    f"request body not received within {self.limits.body_timeout_s:g}s",
                    {"Connection": "close"},
                )
                response.force_close()
                return response
        return await handler(request)


class ApiProtocol(web.RequestHandler):
    """aiohttp's connection handler, capped, with a header clock and JSON errors."""

    __slots__ = ("_counted", "_guard", "_header_clock", "_in_request", "health_only")

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        limits = guard.limits
        super().__init__(
            manager,
            # aiohttp arms this at connect and after each response and closes
            # the connection if no request came by then: the idle timeout.
            keepalive_timeout=limits.idle_timeout_s,
            max_line_size=MAX_HEADER_LINE_BYTES,
            max_field_size=MAX_HEADER_LINE_BYTES,
            max_headers=MAX_HEADERS,
            # After an early answer (408, 413) aiohttp reads and drops what is
            # left of the body for this long, so the client sees the answer
            # rather than a reset; no longer than a body may take anyway.
            lingering_time=min(LINGER_MAX_S, limits.body_timeout_s),
            access_log=None,  # type: ignore[arg-type]  # None is aiohttp's "no access log"
            **kwargs,
        )
        self._guard = guard
        self._header_clock: asyncio.TimerHandle | None = None
        self._in_request = False
        self._counted = False  # holds one of the open_connections
        self.health_only = False  # admitted in the probes' reserve

    @property
    def in_request(self) -> bool:
        """A request's headers are in and its answer is not finished."""
        return self._in_request

    def shed(self) -> None:
        """Closed to make room for a new connection (ConnectionGuard.make_room)."""
        self._guard.open.pop(self, None)
        self._stop_header_clock()
        self.force_close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        admission = guard.admit()
        if admission is None:
            guard.refused()
            stream = cast(asyncio.Transport, transport)  # uvloop's are no subclass of it
            stream.write(OVER_CAP_RESPONSE)
            stream.close()  # after the write is flushed (asyncio Transport.close)
            return
        guard.open[self] = None
        self._counted = True
        self.health_only = admission == "health"
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._counted:
            return  # refused: aiohttp never saw it
        self._counted = False
        self._guard.open.pop(self, None)
        self._stop_header_clock()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and not self._in_request and self._header_clock is None:
            # The first byte of a request starts its clock; the route's
            # middleware (headers complete) or an error answer stops it.
            loop = asyncio.get_running_loop()
            self._header_clock = loop.call_later(
                self._guard.limits.header_timeout_s, self._headers_too_slow
            )
        super().data_received(data)

    def headers_received(self) -> None:
        self._in_request = True
        self._stop_header_clock()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        # An answer without the route's middleware (a 413 on Content-Length,
        # an error answer) ends the request's header clock here.
        self._stop_header_clock()
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._in_request = False  # the next byte is the next request's

    def _stop_header_clock(self) -> None:
        if self._header_clock is not None:
            self._header_clock.cancel()
            self._header_clock = None

    def _headers_too_slow(self) -> None:
        self._header_clock = None
        if self._in_request:
            return
        self._guard.bad_request("header_timeout", 408, _peer(self.transport))
        self.force_close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The parser refused the request (or, never here, aiohttp itself failed):
        a JSON answer, counted, no traceback; the connection is closed after it."""
        self._stop_header_clock()
        if status == 400:
            status, reason, text = classify_parse_error(exc)
            self._guard.bad_request(reason, status, request.remote or "unix")
        else:
            text = "internal error (logged by the supervisor)"
            log.error("api connection error status=%d error=%r action=respond", status, exc)
        if request.writer.output_size > 0:
            # Part of a response went out already: no second one (as aiohttp does).
            raise ConnectionError("response already started; closing the connection")
        response = error_response(status, text, {"Connection": "close"})
        response.force_close()
        return response


def _peer(transport: asyncio.BaseTransport | None) -> str:
    if transport is None:
        return "-"
    name = transport.get_extra_info("peername")
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return "unix"


class GuardedSite(web.BaseSite):
    """A listening socket (`sock`, or one bound to `host`:`port`) served by
    `ApiProtocol`s: aiohttp's SockSite and TCPSite with our protocol."""

    __slots__ = ("_guard", "_host", "_port", "_sock")

    def __init__(
        self,
        runner: web.AppRunner,
        guard: ConnectionGuard,
        *,
        sock: socket.socket | None = None,
        host: str | None = None,
        port: int = 0,
    ) -> None:
        super().__init__(runner)
        self._guard = guard
        self._sock = sock
        self._host = host
        self._port = port

    @property
    def name(self) -> str:
        if self._sock is not None:
            return str(self._sock.getsockname())
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        guard = self._guard

        def protocol() -> ApiProtocol:
            return ApiProtocol(server, guard, loop=loop)

        if self._sock is not None:
            self._server = await loop.create_server(
                protocol, sock=self._sock, backlog=self._backlog
            )
        else:
            self._server = await loop.create_server(
                protocol, self._host, self._port, backlog=self._backlog
            )
