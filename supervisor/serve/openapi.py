"""The route table's types and the OpenAPI 3.0 description built from it (pure, no I/O).

A `Route` holds the handler itself (a bound callable); the server registers
the same `Route`s it describes here, so /openapi.json cannot list a route
that does not exist or miss one that does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from supervisor import __version__

MAX_BODY_BYTES = 64 * 1024  # changing calls take no body; anything big is a mistake

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    where: Literal["query", "path"]
    description: str
    required: bool = False


@dataclass(frozen=True, slots=True)
class Route:
    """One route: the router and /openapi.json are both built from the same tuple."""

    method: Literal["GET", "POST"]
    path: str
    handler: Handler
    summary: str
    changing: bool = False  # needs the unix socket or the bearer token
    params: tuple[Param, ...] = ()
    responses: Mapping[int, str] = field(default_factory=dict)
    content_type: str = "application/json"

    @property
    def operation_id(self) -> str:
        """The handler's own name: `get_placement`, `post_rebind`..."""
        return getattr(self.handler, "__name__", f"{self.method} {self.path}").strip("_")


# What every changing call may answer besides its own responses.
_CHANGING_ERRORS = {
    401: "no or bad bearer token",
    403: "changing calls over TCP need api.token_file",
    409: "the action cannot run now",
    413: f"request body over {MAX_BODY_BYTES} bytes",
}
_ERROR_REF = {"$ref": "#/components/schemas/Error"}


def _responses(route: Route) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for code, text in sorted({200: "ok", **route.responses}.items()):
        schema: dict[str, Any] = _ERROR_REF if code >= 400 else {"type": "object"}
        ctype = route.content_type if code < 400 else "application/json"
        if ctype != "application/json":
            schema = {"type": "string"}
        responses[str(code)] = {"description": text, "content": {ctype: {"schema": schema}}}
    if route.changing:
        for code, text in _CHANGING_ERRORS.items():
            responses[str(code)] = {
                "description": text,
                "content": {"application/json": {"schema": _ERROR_REF}},
            }
    return responses


def _operation(route: Route) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": route.summary,
        "operationId": route.operation_id,
        "responses": _responses(route),
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
    return op


def openapi_doc(routes: Sequence[Route]) -> dict[str, Any]:
    """An OpenAPI 3.0 description of `routes` (served at /openapi.json)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
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
