"""The API's handlers and the route table that binds each path to one of them (no I/O of its own).

Handlers read `store.snapshot` only (never /proc) and answer bodies rendered
by `supervisor.serve.documents` and the metrics collector; a body is cached
per snapshot object, which is sound because a snapshot is immutable and
every change publishes a new one. Changing calls go to the daemon's
`Actions`; who may make them is checked before the handler runs
(`supervisor.serve.server`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from supervisor.errors import SupervisorError
from supervisor.plan.keys import ProcKey
from supervisor.serve.documents import (
    PlacementRenderer,
    dumps,
    events_doc,
    healthz_doc,
    readyz_doc,
    topology_doc,
)
from supervisor.serve.exposition import SnapshotCollector
from supervisor.serve.openapi import Param, Route, openapi_doc
from supervisor.state import EVENTS_KEPT, StateStore
from supervisor.topology.model import Topology

DEFAULT_STALE_AFTER_S = 30.0
EVENTS_DEFAULT_LIMIT = 100
_NUMBER_RE = re.compile(r"[0-9]{1,9}")  # int() also takes " 3", "+3", "1_0"


class Actions(Protocol):
    """What the changing calls do; the daemon implements it.

    Raise KeyError for an unknown rank (404) and a `SupervisorError` when the
    action cannot run now, e.g. while stopping (409, with its message).
    """

    async def rebind(self, rank: ProcKey | None) -> dict[str, Any]: ...

    async def restart(self, rank: ProcKey) -> dict[str, Any]: ...


class ApiError(Exception):
    """An error answer a handler decided on: becomes `{"error", "status"}`."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


def error_response(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=dumps({"error": message, "status": status}),
        content_type="application/json",
        headers=headers,
    )


def json_response(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=dumps(doc), content_type="application/json")


def _parse_rank(text: str | None, where: str) -> ProcKey:
    if text == "engine":
        return "engine"
    if text is None or not _NUMBER_RE.fullmatch(text):
        raise ApiError(400, f"{where}: expected a rank number (0, 1, ...) or engine, got {text!r}")
    return int(text)


def _int_query(
    request: web.Request, name: str, default: int | None, lo: int, hi: int
) -> int | None:
    text = request.query.get(name)
    if text is None:
        return default
    if not _NUMBER_RE.fullmatch(text) or not lo <= int(text) <= hi:
        raise ApiError(400, f"?{name}: expected an integer {lo}-{hi}, got {text!r}")
    return int(text)


class Handlers:
    """One handler per route, over the daemon's store, actions and metrics collector."""

    def __init__(
        self,
        store: StateStore,
        actions: Actions,
        collector: SnapshotCollector,
        *,
        stale_after_s: float | Callable[[], float] = DEFAULT_STALE_AFTER_S,
    ) -> None:
        self._store = store
        self._actions = actions
        self._collector = collector
        # A callable reads the threshold of the config in force (a reload changes it).
        self._stale_after_s = (
            stale_after_s if callable(stale_after_s) else (lambda: float(stale_after_s))
        )
        self.up_since = time.time()  # the server sets it when it starts listening
        self._placement = PlacementRenderer()
        self._topology: tuple[Topology, bytes] | None = None
        self.routes = self._route_table()
        self._openapi = dumps(openapi_doc(self.routes))

    # -- read-only routes ------------------------------------------------------------

    async def get_placement(self, request: web.Request) -> web.Response:
        body = self._placement.render(self._store.snapshot)
        return web.Response(body=body, content_type="application/json")

    async def get_topology(self, request: web.Request) -> web.Response:
        topo = self._store.snapshot.topology
        if self._topology is None or self._topology[0] is not topo:
            self._topology = (topo, dumps(topology_doc(topo)))  # once per re-plan
        return web.Response(body=self._topology[1], content_type="application/json")

    async def get_healthz(self, request: web.Request) -> web.Response:
        doc = healthz_doc(self._store.snapshot, time.time(), self._stale_after_s(), self.up_since)
        return json_response(doc, doc["status"])

    async def get_readyz(self, request: web.Request) -> web.Response:
        doc = readyz_doc(self._store.snapshot)
        return json_response(doc, doc["status"])

    async def get_metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = self._collector.exposition(encoder, content_type)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def get_events(self, request: web.Request) -> web.Response:
        since = _int_query(request, "since", None, 0, 999_999_999)
        limit = _int_query(request, "limit", EVENTS_DEFAULT_LIMIT, 1, EVENTS_KEPT)
        assert limit is not None  # it has a default
        return json_response(events_doc(self._store.snapshot, since, limit))

    async def get_openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    # -- changing routes (the server checks the caller first) ------------------------

    async def post_rebind(self, request: web.Request) -> web.Response:
        text = request.query.get("rank")
        rank = None if text is None else _parse_rank(text, "rank")
        return await self._changing(request, "rebind", rank, lambda: self._actions.rebind(rank))

    async def post_restart(self, request: web.Request) -> web.Response:
        rank = _parse_rank(request.match_info["rank"], "rank")
        return await self._changing(request, "restart", rank, lambda: self._actions.restart(rank))

    async def _changing(
        self,
        request: web.Request,
        what: str,
        rank: ProcKey | None,
        action: Callable[[], Awaitable[dict[str, Any]]],
    ) -> web.Response:
        await request.read()  # enforces client_max_size on a chunked body (413)
        try:
            result = await action()
        except KeyError:
            raise ApiError(404, f"no rank {rank} in the plan") from None
        except SupervisorError as err:
            raise ApiError(409, f"{what} refused: {err}") from None
        return json_response(result)

    # -- the table --------------------------------------------------------------------

    def _route_table(self) -> tuple[Route, ...]:
        rank_query = Param("rank", "query", "A rank number or engine; without it, every process.")
        return (
            Route(
                "GET",
                "/placement",
                self.get_placement,
                "The plan document with pid, state, observed placement and drift per process.",
                responses={200: "the placement document"},
            ),
            Route("GET", "/topology", self.get_topology, "The discovered host topology."),
            Route(
                "GET",
                "/healthz",
                self.get_healthz,
                "The supervisor's loop is alive: the last placement check is recent.",
                responses={200: "alive", 503: "no check finished recently"},
            ),
            Route(
                "GET",
                "/readyz",
                self.get_readyz,
                "Every process is running and bound as planned.",
                responses={200: "ready", 503: "not ready, with the reasons"},
            ),
            Route(
                "GET",
                "/metrics",
                self.get_metrics,
                "Prometheus metrics (text format; OpenMetrics when the Accept header asks).",
                content_type="text/plain",
            ),
            Route(
                "GET",
                "/events",
                self.get_events,
                "Recent bind, drift and restart events.",
                params=(
                    Param("since", "query", "Only events with a sequence number above this."),
                    Param(
                        "limit",
                        "query",
                        f"At most this many events (1-{EVENTS_KEPT}, default 100).",
                    ),
                ),
                responses={200: "events", 400: "bad since or limit"},
            ),
            Route("GET", "/openapi.json", self.get_openapi, "This description of the API."),
            Route(
                "POST",
                "/rebind",
                self.post_rebind,
                "Apply the plan again to every process, or to one rank.",
                changing=True,
                params=(rank_query,),
                responses={200: "what was re-bound", 400: "bad rank", 404: "unknown rank"},
            ),
            Route(
                "POST",
                "/ranks/{rank}/restart",
                self.post_restart,
                "Restart one rank's worker.",
                changing=True,
                params=(Param("rank", "path", "The rank number, or engine.", required=True),),
                responses={200: "the restart was started", 400: "bad rank", 404: "unknown rank"},
            ),
        )
