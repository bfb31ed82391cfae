"""The HTTP API over real TCP and unix sockets, against an ApiServer over a planned snapshot.

The `Actions` object is a recording fake (a collaborator, not the thing under
test); everything else is real: aiohttp, sockets, the token file, the socket
file's mode.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import ApiConfig
from supervisor.errors import ConfigError, SupervisorError
from supervisor.listen import Listen, parse_listen
from supervisor.plan.placement import Placement
from supervisor.serve.documents import PlacementRenderer, placement_doc
from supervisor.serve.server import ApiServer, ListenError
from supervisor.serve.status import http_request
from supervisor.state import Event, Observation, ProcessStatus, StateStore
from tests.support.api_fixture import RecordingActions, ServerThread, realistic_snapshot

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[ServerThread]:
    sock = tmp_path_factory.mktemp("sock") / "api.sock"
    config = ApiConfig(
        listen=parse_listen("127.0.0.1:0"), unix_socket=str(sock), token_file=str(token_file)
    )
    with ServerThread(realistic_snapshot(), config) as srv:
        yield srv
    # No handler may block the loop: the whole module ran in asyncio debug mode.
    assert srv.slow_callbacks == []


@pytest.fixture(autouse=True)
def _fresh_calls(request: pytest.FixtureRequest) -> None:
    if "server" in request.fixturenames:
        srv: ServerThread = request.getfixturevalue("server")
        assert isinstance(srv.actions, RecordingActions)
        srv.actions.calls.clear()


def get(where: Listen, path: str, **kw: Any) -> tuple[int, dict[str, str], Any]:
    code, headers, body = http_request(where, kw.pop("method", "GET"), path, **kw)
    doc = (
        json.loads(body) if headers.get("content-type", "").startswith("application/json") else body
    )
    return code, headers, doc


def unix(srv: ServerThread) -> Listen:
    return Listen(path=next(a[5:] for a in srv.server.addresses if a.startswith("unix:")))


def assert_error(doc: Any, status: int) -> None:
    assert isinstance(doc, dict)
    assert doc["status"] == status
    assert isinstance(doc["error"], str) and doc["error"]
    assert "Traceback" not in doc["error"]


# -- read-only routes -----------------------------------------------------------


def test_placement_is_the_plan_document_with_live_state(server: ServerThread) -> None:
    code, headers, doc = get(server.tcp, "/placement")
    assert code == 200
    assert headers["content-type"].startswith("application/json")
    snap = server.store.snapshot
    # The plan part reads back into the very Placement the daemon holds.
    assert Placement.from_doc(doc) == snap.placement
    entries = {"engine": doc["engine"]} | {e["rank"]: e for e in doc["ranks"]}
    assert set(entries) == set(snap.keys())
    for key, entry in entries.items():
        status = snap.processes[key]
        assert entry["pid"] == status.pid
        assert entry["state"] == "running"
        observed = entry["observed"]
        obs = snap.observed[key]
        assert [t["tid"] for t in observed["threads"]] == [t.tid for t in obs.threads]
        assert set(observed["threads"][0]) >= {"tid", "name", "role", "cpus"}
        # JSON object keys are strings: node ids become "0", "1".
        assert observed["memory_bytes_by_node"] == {
            str(n): b for n, b in obs.memory_bytes_by_node.items()
        }
        assert observed["local_memory_ratio"] == pytest.approx(obs.local_memory_ratio)
        assert isinstance(observed["irqs"], list)
        assert entry["drift"] == [f.to_doc() for f in snap.drift[key]]
        assert entry["mempolicy"]["step"] == "bind"
        assert set(entry["backoff"]) == {"seconds", "next_start_at"}
    assert entries[1]["drift"][0]["kind"] == "thread_affinity"
    assert entries[0]["observed"]["irqs"][0]["irq"] == 100
    assert entries[2]["restarts"] == 1
    assert doc["supervisor"]["ready"] is True


def test_placement_follows_each_new_snapshot(server: ServerThread) -> None:
    """Bodies are cached per snapshot: a new snapshot must show at once."""
    _, _, before = get(server.tcp, "/placement")
    old = server.store.snapshot.processes[3]
    server.change(lambda s: s.set_process(replace(old, pid=99999, state="backoff")))
    try:
        _, _, after = get(server.tcp, "/placement")
        assert before["ranks"][3]["pid"] == old.pid
        assert after["ranks"][3]["pid"] == 99999
        assert after["ranks"][3]["state"] == "backoff"
    finally:
        server.change(lambda s: s.set_process(old))


def test_metrics_follow_what_they_show_and_not_events(server: ServerThread) -> None:
    """/metrics is rendered again when a value it shows changed, and not for a
    new snapshot that only adds an event."""

    def restarts_of_rank_3() -> bytes:
        code, _, body = get(server.tcp, "/metrics")
        assert code == 200
        return next(
            line
            for line in body.splitlines()
            if line.startswith(b'placement_restarts_total{rank="3"}')
        )

    renderer = server.server.collector.renderer
    built = renderer.built
    # The self-usage sampler may publish meanwhile: its families do not count.
    sampled = {f.name for f in renderer.families if "self_usage" in f.inputs}

    before = restarts_of_rank_3()
    first = dict(built)
    server.change(lambda s: s.emit("note", 3, "an event only"))
    restarts_of_rank_3()
    # No family was built again: nothing it shows changed.
    assert {k: n for k, n in built.items() if k not in sampled} == {
        k: n for k, n in first.items() if k not in sampled
    }
    server.change(lambda s: s.count("restarts", "3"))
    after = restarts_of_rank_3()
    assert float(after.split()[-1]) == float(before.split()[-1]) + 1
    # Only the family that reads `counters.restarts` was built again.
    again = {name for name, n in built.items() if n != first[name]} - sampled
    assert again == {"placement_restarts"}


def test_metrics_show_the_servers_own_cpu_and_memory(server: ServerThread) -> None:
    """The server samples its process on a timer from start(); /metrics shows the sample."""

    async def after_the_first_sample() -> None:
        pass  # queued behind the sampler task that start() created

    server.run(after_the_first_sample())
    usage = server.store.snapshot.self_usage
    assert usage is not None and usage.cpu_seconds > 0 and usage.resident_memory_bytes > 0
    _, _, body = get(server.tcp, "/metrics")
    lines = dict(
        line.split(b" ", 1)
        for line in body.splitlines()
        if line.startswith(b"placement_supervisor_")
    )
    assert set(lines) == {
        b"placement_supervisor_cpu_seconds_total",
        b"placement_supervisor_resident_memory_bytes",
    }
    assert float(lines[b"placement_supervisor_resident_memory_bytes"]) > 10 << 20


def test_placement_over_the_unix_socket(server: ServerThread) -> None:
    path = unix(server).path
    assert path is not None
    # Only the owner may connect: requests over it are trusted without a token.
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    code, _, doc = get(unix(server), "/placement")
    assert code == 200
    assert [r["pid"] for r in doc["ranks"]] == [
        server.store.snapshot.processes[r.rank].pid for r in server.store.snapshot.placement.ranks
    ]


def test_topology(server: ServerThread) -> None:
    code, _, doc = get(server.tcp, "/topology")
    assert code == 200
    assert len(doc["cpus"]) == 48
    # The same document as `topology --json` (or a field copy before that existed).
    bus_ids = [d.get("bus_id", d.get("bdf")) for d in doc["devices"]]
    assert bus_ids == [d.bdf for d in server.store.snapshot.topology.devices]


def test_healthz_ok_then_stale(server: ServerThread) -> None:
    code, _, doc = get(server.tcp, "/healthz")
    assert code == 200
    assert doc["checks"] == server.store.snapshot.counters.checks
    counters = server.store.snapshot.counters
    server.change(lambda s: s.update(counters=replace(counters, last_check_at=1.0)))
    try:
        code, _, doc = get(server.tcp, "/healthz")
        assert code == 503
        assert_error(doc, 503)
        assert "no placement check finished" in doc["error"]
    finally:
        server.change(lambda s: s.update(counters=counters))


def test_readyz_says_which_process_is_not_ready(server: ServerThread) -> None:
    assert get(server.tcp, "/readyz")[0] == 200
    old = server.store.snapshot.processes[2]
    server.change(lambda s: s.set_process(replace(old, state="backoff", backoff_s=4.0)))
    try:
        code, _, doc = get(server.tcp, "/readyz")
        assert code == 503
        assert_error(doc, 503)
        assert doc["reasons"] == ["2: backoff"]
    finally:
        server.change(lambda s: s.set_process(old))


def test_metrics_text_and_openmetrics(server: ServerThread) -> None:
    code, headers, body = get(server.tcp, "/metrics")
    assert code == 200
    assert headers["content-type"].startswith("text/plain")
    assert b'placement_up{rank="engine"} 1.0' in body
    code, headers, body = get(
        server.tcp,
        "/metrics",
        headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"},
    )
    assert code == 200
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


def test_events_since_and_limit(server: ServerThread) -> None:
    def emit(store: StateStore) -> None:
        for i in range(5):
            store.emit("drift", 1, f"finding {i}", tid=4242 + i, cpus=frozenset({1, 2}))

    server.change(emit)
    events: tuple[Event, ...] = server.store.snapshot.events
    first = events[-5].seq
    code, _, doc = get(server.tcp, f"/events?since={first}")
    assert code == 200
    assert [e["seq"] for e in doc["events"]] == [first + 1, first + 2, first + 3, first + 4]
    assert doc["events"][0]["rank"] == "1"
    assert doc["events"][0]["fields"] == {"tid": 4243, "cpus": [1, 2]}
    assert doc["latest_seq"] == first + 4
    _, _, doc = get(server.tcp, f"/events?since={first}&limit=2")
    assert [e["seq"] for e in doc["events"]] == [first + 1, first + 2]
    assert doc["next_since"] == first + 2
    _, _, doc = get(server.tcp, "/events?limit=2")
    assert [e["seq"] for e in doc["events"]] == [first + 3, first + 4]
    _, _, doc = get(server.tcp, f"/events?since={first + 4}")
    assert doc["events"] == []
    assert doc["next_since"] == first + 4
    for bad in ("since=-1", "since=x", "limit=0", "limit=100000", "limit="):
        code, _, doc = get(server.tcp, f"/events?{bad}")
        assert code == 400, bad
        assert_error(doc, 400)


# -- changing routes: authorisation -------------------------------------------------


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_rebind_needs_the_token_over_tcp(server: ServerThread) -> None:
    code, headers, doc = get(server.tcp, "/rebind", method="POST")
    assert code == 401
    assert_error(doc, 401)
    assert headers["www-authenticate"].startswith("Bearer")
    for header in (bearer("wrong"), bearer(TOKEN + "x"), {"Authorization": f"Basic {TOKEN}"}):
        code, _, doc = get(server.tcp, "/rebind", method="POST", headers=header)
        assert code == 401, header
        assert_error(doc, 401)
    assert server.actions.calls == []
    code, _, doc = get(server.tcp, "/rebind", method="POST", headers=bearer(TOKEN))
    assert code == 200
    assert doc == {"rebound": ["engine", 0, 1, 2, 3]}
    assert server.actions.calls == [("rebind", None)]


def test_unix_socket_needs_no_token(server: ServerThread) -> None:
    code, _, doc = get(unix(server), "/rebind?rank=1", method="POST")
    assert code == 200
    assert doc == {"rebound": [1]}
    code, _, doc = get(unix(server), "/ranks/3/restart", method="POST")
    assert code == 200
    assert server.actions.calls == [("rebind", 1), ("restart", 3)]


def test_without_a_token_file_tcp_changes_are_refused(tmp_path: Path) -> None:
    sock = tmp_path / "api.sock"
    config = ApiConfig(listen=parse_listen("127.0.0.1:0"), unix_socket=str(sock))
    with ServerThread(realistic_snapshot(), config) as srv:
        for path in ("/rebind", "/ranks/0/restart"):
            code, _, doc = get(srv.tcp, path, method="POST", headers=bearer(TOKEN))
            assert code == 403
            assert_error(doc, 403)
            assert "token_file" in doc["error"]
        assert srv.actions.calls == []
        assert get(unix(srv), "/ranks/0/restart", method="POST")[0] == 200
        assert srv.actions.calls == [("restart", 0)]
    # stop() removes the socket file it created.
    assert not sock.exists()


def test_restart_and_rank_errors(server: ServerThread) -> None:
    auth = bearer(TOKEN)
    code, _, doc = get(server.tcp, "/ranks/2/restart", method="POST", headers=auth)
    assert (code, doc) == (200, {"restarting": 2})
    # The engine is a process like the ranks: it can be restarted and re-bound too.
    code, _, doc = get(server.tcp, "/ranks/engine/restart", method="POST", headers=auth)
    assert (code, doc) == (200, {"restarting": "engine"})
    code, _, doc = get(server.tcp, "/rebind?rank=engine", method="POST", headers=auth)
    assert (code, doc) == (200, {"rebound": ["engine"]})
    for path, status in [
        ("/ranks/9/restart", 404),
        ("/ranks/x/restart", 400),
        ("/ranks/Engine/restart", 400),
        ("/ranks/-1/restart", 400),
        ("/rebind?rank=7", 404),
        ("/rebind?rank=-1", 400),
        ("/rebind?rank=1.5", 400),
        ("/rebind?rank=", 400),
    ]:
        code, _, doc = get(server.tcp, path, method="POST", headers=auth)
        assert code == status, path
        assert_error(doc, status)
    assert server.actions.calls == [("restart", 2), ("restart", "engine"), ("rebind", "engine")]


def test_unknown_route_and_wrong_method(server: ServerThread) -> None:
    code, _, doc = get(server.tcp, "/nope")
    assert code == 404
    assert_error(doc, 404)
    code, headers, doc = get(server.tcp, "/rebind")
    assert code == 405
    assert_error(doc, 405)
    assert headers["allow"] == "POST"
    code, _, doc = get(server.tcp, "/placement", method="POST", headers=bearer(TOKEN))
    assert code == 405
    assert_error(doc, 405)
    code, _, doc = get(server.tcp, "/ranks/1/restart", method="DELETE", headers=bearer(TOKEN))
    assert code == 405


def test_oversized_body_is_refused(server: ServerThread) -> None:
    big = b"x" * (100 * 1024)
    code, _, doc = get(server.tcp, "/rebind", method="POST", headers=bearer(TOKEN), body=big)
    assert code == 413
    assert_error(doc, 413)

    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b"y" * 4096

    # Chunked: no Content-Length, so the limit is enforced while reading.
    conn_code, _, body = _chunked_post(server.tcp, "/rebind", chunks())
    assert conn_code == 413
    assert_error(json.loads(body), 413)
    assert server.actions.calls == []


def _chunked_post(where: Listen, path: str, body: Iterator[bytes]) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection(where.connect_host(), where.port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers=bearer(TOKEN), encode_chunked=True)
        resp = conn.getresponse()
        return resp.status, resp.reason, resp.read()
    finally:
        conn.close()


class _FailingActions:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def rebind(self, rank: int | None) -> dict[str, Any]:
        raise self.exc

    async def restart(self, rank: int) -> dict[str, Any]:
        raise self.exc


def test_action_errors_map_to_status_codes_without_tracebacks(tmp_path: Path) -> None:
    config = ApiConfig(listen=parse_listen("127.0.0.1:0"), unix_socket=str(tmp_path / "s"))
    secret = "internal detail /etc/shadow"
    with ServerThread(
        realistic_snapshot(), config, actions=_FailingActions(RuntimeError(secret))
    ) as srv:
        code, _, body = http_request(unix(srv), "POST", "/rebind")
        assert code == 500
        doc = json.loads(body)
        assert_error(doc, 500)
        assert secret not in body.decode()
        assert b"Traceback" not in body
    with ServerThread(
        realistic_snapshot(),
        config,
        actions=_FailingActions(SupervisorError("the supervisor is stopping")),
    ) as srv:
        code, _, body = http_request(unix(srv), "POST", "/ranks/1/restart")
        assert code == 409
        assert "stopping" in json.loads(body)["error"]


# -- the OpenAPI description ----------------------------------------------------------


def router_routes(server: ApiServer) -> set[tuple[str, str]]:
    out = set()
    for route in server.app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if route.method != "HEAD":
            out.add((route.method, str(path)))
    return out


def test_openapi_lists_exactly_the_routes_that_exist(server: ServerThread) -> None:
    code, _, doc = get(server.tcp, "/openapi.json")
    assert code == 200
    assert doc["openapi"].startswith("3.")
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == router_routes(server.server)
    assert len(documented) == len(server.server.routes)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["summary"] and "200" in op["responses"], (method, path)
            if method == "post":
                assert {"401", "403", "413"} <= set(op["responses"])
    # Every documented GET answers (no 404/405), so the description is not stale.
    for method, path in documented:
        if method == "GET":
            code = http_request(server.tcp, "GET", path)[0]
            assert code in (200, 503), path


# -- listening ------------------------------------------------------------------------


def test_port_zero_reports_the_real_port_and_a_taken_port_is_one_clear_error(
    server: ServerThread,
) -> None:
    addresses = server.server.addresses
    assert addresses[0].startswith("127.0.0.1:")
    port = server.tcp.port
    assert port != 0
    probe = socket.create_connection(("127.0.0.1", port), timeout=5)
    probe.close()
    other = ServerThread(realistic_snapshot(), ApiConfig(), listen=f"127.0.0.1:{port}")
    with pytest.raises(ListenError, match=r"127\.0\.0\.1:\d+: address already in use"):
        other.__enter__()


def test_listen_on_a_unix_socket_only(tmp_path: Path) -> None:
    path = tmp_path / "only.sock"
    with ServerThread(realistic_snapshot(), ApiConfig(), listen=f"unix:{path}") as srv:
        assert srv.server.addresses == (f"unix:{path}",)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert http_request(Listen(path=str(path)), "GET", "/readyz")[0] == 200


def test_stale_socket_is_replaced_but_a_plain_file_is_not(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))
    dead.close()  # a socket file nobody listens on, as a killed daemon leaves it
    with ServerThread(realistic_snapshot(), ApiConfig(), listen=f"unix:{stale}") as srv:
        assert http_request(Listen(path=str(stale)), "GET", "/healthz")[0] == 200
        # A second server on the same live socket is refused, not stolen.
        with pytest.raises(ListenError, match="already in use"):
            ServerThread(realistic_snapshot(), ApiConfig(), listen=f"unix:{stale}").__enter__()
        assert srv.server.addresses == (f"unix:{stale}",)
    plain = tmp_path / "plain"
    plain.write_text("keep me")
    with pytest.raises(ListenError, match="not a socket"):
        ServerThread(realistic_snapshot(), ApiConfig(), listen=f"unix:{plain}").__enter__()
    assert plain.read_text() == "keep me"


def test_unreadable_token_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    srv = ServerThread(
        realistic_snapshot(), ApiConfig(listen=parse_listen("127.0.0.1:0"), token_file=str(missing))
    )
    with pytest.raises(ConfigError, match=r"missing: api\.token_file: cannot read"):
        srv.__enter__()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    srv = ServerThread(
        realistic_snapshot(), ApiConfig(listen=parse_listen("127.0.0.1:0"), token_file=str(empty))
    )
    with pytest.raises(ConfigError, match="empty"):
        srv.__enter__()


def test_processes_without_status_yet_are_shown_as_starting(tmp_path: Path) -> None:
    snap = realistic_snapshot()
    snap = replace(
        snap, processes={"engine": ProcessStatus("engine", "running", pid=5)}, observed={}, drift={}
    )
    with ServerThread(snap, ApiConfig(listen=parse_listen(f"unix:{tmp_path / 's'}"))) as srv:
        where = Listen(path=str(tmp_path / "s"))
        _, _, body = http_request(where, "GET", "/placement")
        doc = json.loads(body)
        assert [r["state"] for r in doc["ranks"]] == ["starting"] * 4
        assert [r["pid"] for r in doc["ranks"]] == [None] * 4
        assert doc["ranks"][0]["observed"]["threads"] == []
        code, _, body = http_request(where, "GET", "/readyz")
        assert code == 503
        assert "0: not started yet" in json.loads(body)["reasons"]
        assert srv.server.addresses


def test_placement_renderer_reuses_processes_and_matches_the_plain_document() -> None:
    """The per-process reuse behind GET /placement renders exactly what
    placement_doc does, through a run of snapshot changes."""
    store = StateStore(realistic_snapshot())
    renderer = PlacementRenderer()

    def same() -> bytes:
        body = renderer.render(store.snapshot)
        assert json.loads(body) == json.loads(json.dumps(placement_doc(store.snapshot)))
        return body

    first = same()
    store.emit("note", None, "an event changes nothing a process shows")
    second = same()
    assert second == first  # an event is not part of /placement
    old = store.snapshot.processes[1]
    store.set_process(replace(old, state="backoff", pid=None, restarts=old.restarts + 1))
    third = same()
    assert third != second and b'"state":"backoff"' in third
    store.set_observation(2, Observation(observed_at=1.0), ())
    same()
    store.update(placement=replace(store.snapshot.placement, warnings=("a new warning",)))
    assert b"a new warning" in same()
