"""The API's connection guard over real sockets: JSON 431/400, the cap, the three timeouts.

An ApiServer runs on its own loop (ServerThread); the clients are raw
sockets, so a request can be as broken, as large or as slow as the test
needs. Log records of the guard and of aiohttp's own loggers are captured
to show that a bad request costs a counter, not a traceback.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from supervisor.bind.fdlimit import MIN_FD_RESERVE, plan_fd_budget
from supervisor.config import ApiConfig
from supervisor.listen import Listen, parse_listen
from supervisor.serve.guard import HEALTH_RESERVE, MAX_HEADER_LINE_BYTES, ConnectionGuard, Limits
from supervisor.state import StateStore
from tests.support.api_fixture import ServerThread, realistic_snapshot
from tests.support.poll import poll

GOOD = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
BIG_HEADER = b"X-Pad: " + b"a" * 9000 + b"\r\n"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    names = ("supervisor.serve.guard", "aiohttp.server", "aiohttp.access", "aiohttp.web")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    yield handler
    for lg, level in zip(loggers, levels, strict=True):
        lg.removeHandler(handler)
        lg.setLevel(level)


def serve(**api: Any) -> ServerThread:
    return ServerThread(realistic_snapshot(), ApiConfig(listen=parse_listen("127.0.0.1:0"), **api))


def addr(srv: ServerThread) -> tuple[str, int]:
    where: Listen = srv.tcp
    return where.connect_host(), where.port


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def exchange(where: tuple[str, int], data: bytes) -> tuple[int, dict[str, str], Any]:
    """Send `data` on a fresh connection, read to EOF; the status, headers, JSON body."""
    with socket.create_connection(where, timeout=10) as sock:
        sock.sendall(data)
        status, headers, body = parse(read_all(sock))
    assert headers["content-type"].startswith("application/json"), headers
    return status, headers, json.loads(body)


def counter(srv: ServerThread, reason: str) -> int:
    return srv.store.snapshot.counters.http_bad_requests.get(reason, 0)


def test_a_header_over_the_limit_is_a_json_431_counted_and_logged_once(records: Records) -> None:
    with serve() as srv:
        for _ in range(50):
            status, headers, doc = exchange(addr(srv), b"GET /placement HTTP/1.1\r\n" + BIG_HEADER)
            assert status == 431
            assert doc["status"] == 431 and str(MAX_HEADER_LINE_BYTES) in doc["error"]
            assert "aaaa" not in doc["error"]  # the offending bytes are not echoed back
            assert headers["connection"] == "close"
        assert counter(srv, "headers_too_large") == 50
        metrics = srv.server.registry.get_sample_value(
            "placement_http_bad_requests_total", {"reason": "headers_too_large"}
        )
        assert metrics == 50
        assert (
            srv.server.registry.get_sample_value(
                "placement_http_bad_requests_total", {"reason": "malformed"}
            )
            == 0
        )
    ours = [r for r in records.records if r.name == "supervisor.serve.guard"]
    # The first is logged at once, the rest only in the summary (here: the stop's flush).
    assert len(ours) == 2, [r.getMessage() for r in ours]
    assert "reason=headers_too_large" in ours[0].getMessage()
    assert "count=50 reasons=headers_too_large:50" in ours[1].getMessage()
    assert not [r for r in records.records if r.name.startswith("aiohttp")]
    assert not [r for r in records.records if r.exc_info]


def test_a_malformed_request_line_is_a_json_400_without_a_traceback(records: Records) -> None:
    with serve() as srv:
        for request in (b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"):
            status, _, doc = exchange(addr(srv), request)
            assert status == 400 and doc["status"] == 400
            assert doc["error"].startswith("bad request")
        assert counter(srv, "malformed") == 2
    assert not [r for r in records.records if r.exc_info or r.name.startswith("aiohttp")]


SLOW_BODY = b"POST /rebind HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"


def in_requests(srv: ServerThread, n: int) -> list[socket.socket]:
    """`n` connections each in a request (headers in, its body still coming)."""
    held = []
    for _ in range(n):
        sock = socket.create_connection(addr(srv), timeout=10)
        sock.sendall(SLOW_BODY)
        held.append(sock)
    poll(
        lambda: sum(p.in_request for p in srv.server.guard.open) == n,
        what=f"{n} connections in a request",
    )
    return held


def test_idle_connections_at_the_cap_give_way_to_a_new_probe() -> None:
    # 256 idle connections (the default cap) took /healthz away until their idle
    # timeout (issue 30); now the oldest idle one is closed for the new one.
    with serve() as srv:
        cap = srv.server.guard.limits.max_connections
        held = [socket.create_connection(addr(srv), timeout=10) for _ in range(cap)]
        try:
            poll(lambda: srv.server.guard.open_connections == cap, what=f"{cap} idle connections")
            for path in ("/healthz", "/readyz"):
                request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                status, _, doc = exchange(addr(srv), request.encode())
                assert status in (200, 503) and "too many connections" not in str(doc), doc
            # One of them was shed for the first probe (the oldest accepted: past the
            # listen backlog the kernel's accept order need not be the connect order);
            # the second probe took the place the first one left.
            closed, _, _ = select.select(held, [], [], 5.0)
            assert len(closed) == 1 and closed[0].recv(1) == b""
            assert srv.server.guard.shed == 1
            assert (
                srv.server.registry.get_sample_value("placement_http_connections_shed_total") == 1
            )
            assert srv.store.snapshot.counters.http_connections_refused == 0
        finally:
            for sock in held:
                sock.close()


def test_with_every_connection_in_a_request_the_reserve_serves_the_probes_only() -> None:
    with serve(max_connections=3) as srv:
        held = in_requests(srv, 3)
        try:
            status, _, doc = exchange(addr(srv), GOOD)
            assert status == 200, doc
            status, headers, doc = exchange(
                addr(srv), b"GET /placement HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            assert status == 503 and doc["status"] == 503 and headers["retry-after"] == "1"
            assert "only /healthz and /readyz" in doc["error"]
            assert srv.store.snapshot.counters.http_connections_refused == 1
            assert (
                srv.server.registry.get_sample_value("placement_http_connections_refused_total")
                == 1
            )
        finally:
            for sock in held:
                sock.close()
        poll(lambda: srv.server.guard.open_connections == 0, what="all closed")
        status, _, _ = exchange(
            addr(srv), b"GET /placement HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert status == 200


class Held:
    """What `ConnectionGuard.admit` looks at in an open connection."""

    def __init__(self, guard: ConnectionGuard, in_request: bool) -> None:
        self.guard, self.in_request, self.was_shed = guard, in_request, False
        guard.open[self] = None  # type: ignore[index]

    def shed(self) -> None:
        self.was_shed = True
        del self.guard.open[self]  # type: ignore[arg-type]


def test_admission_past_the_cap_and_the_reserve_is_refused() -> None:
    guard = ConnectionGuard(StateStore(realistic_snapshot()), Limits(2, 10.0, 30.0, 60.0))
    busy = [Held(guard, True) for _ in range(2)]
    assert guard.admit() == "health"
    busy += [Held(guard, True) for _ in range(HEALTH_RESERVE - 1)]
    idle = Held(guard, False)  # the cap and the reserve are full
    assert guard.admit() == "health" and idle.was_shed and not any(b.was_shed for b in busy)
    busy.append(Held(guard, True))
    assert guard.admit() is None  # every one in a request: the 503 before a byte is read


def test_headers_slower_than_the_header_timeout_are_cut_off() -> None:
    with serve(header_timeout_s=0.3, idle_timeout_s=30) as srv:
        with socket.create_connection(addr(srv), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never the blank line
            assert read_all(sock) == b""  # closed, no answer
            waited = time.monotonic() - started
        assert 0.25 <= waited < 10
        assert counter(srv, "header_timeout") == 1


def test_an_idle_keepalive_connection_outlives_the_header_timeout_not_the_idle_one() -> None:
    with serve(header_timeout_s=0.2, idle_timeout_s=1.0) as srv:
        with socket.create_connection(addr(srv), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            assert read_all(sock) == b""  # the idle timeout closes it
            waited = time.monotonic() - started
        # Idle between requests is the idle clock's, not the header clock's.
        assert 0.8 <= waited < 10
        assert counter(srv, "header_timeout") == 0


def test_a_body_slower_than_the_body_timeout_is_a_json_408(tmp_path: Any) -> None:
    token = tmp_path / "token"
    token.write_text("t0k3n\n")
    token.chmod(0o600)
    with serve(body_timeout_s=0.3, token_file=str(token)) as srv:
        request = (
            b"POST /rebind HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0k3n\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        status, _, doc = exchange(addr(srv), request)
        assert status == 408 and doc["status"] == 408
        assert counter(srv, "body_timeout") == 1


def test_the_fd_budget_keeps_a_reserve_under_the_soft_limit() -> None:
    assert plan_fd_budget(256, 1 << 20).max_connections == 256  # plenty: as configured
    low = plan_fd_budget(256, 256)
    assert low.lowered and low.max_connections + low.reserve_fds <= 256
    assert low.reserve_fds >= MIN_FD_RESERVE
    big = plan_fd_budget(60000, 65536)
    assert big.reserve_fds == 65536 // 4 and big.max_connections == 65536 - 65536 // 4
    assert plan_fd_budget(256, 100).max_connections == 1  # never none at all


def test_a_413_before_the_body_is_read_stops_the_header_clock() -> None:
    # aiohttp lingers body_timeout_s reading the unsent body, then closes:
    # longer than the header clock, which must not fire meanwhile.
    with serve(header_timeout_s=0.3, body_timeout_s=1.0, idle_timeout_s=30) as srv:
        with socket.create_connection(addr(srv), timeout=10) as sock:
            sock.sendall(b"POST /rebind HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
            head = sock.recv(65536)
            assert head.startswith(b"HTTP/1.1 413")
            started = time.monotonic()
            read_all(sock)  # closed by the server after lingering
            waited = time.monotonic() - started
        assert waited >= 0.5  # the header clock's 0.3 s passed while the connection lived
        assert counter(srv, "header_timeout") == 0
