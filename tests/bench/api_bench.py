"""Benchmark: GET /placement and /metrics latency at 50 concurrent clients.

    .venv/bin/python -m tests.bench.api_bench [--requests 2000] [--clients 50]

The server side runs one event loop holding the ApiServer over a snapshot of
16 ranks x 100 threads (plus the engine), a task that publishes a new
snapshot every 100 ms (as a running check loop does), and a bare aiohttp
endpoint returning a small fixed JSON: the baseline, measured in the same
run. The clients run in a separate process (so they do not share the
server's GIL), 50 keep-alive connections each issuing requests back to back.
Printed: p50/p99 per endpoint, with and without the per-snapshot body cache,
and the ratio to the bare endpoint (target: within 2x). A second bare
endpoint returns a fixed body as large as /placement's, to tell the cost of
the handler from the cost of moving ~130 KiB per response.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace

from aiohttp import ClientSession, TCPConnector, web

from supervisor.config import ApiConfig
from supervisor.serve.documents import placement_doc
from supervisor.serve.server import ApiServer
from supervisor.state import StateStore
from tests.support.api_fixture import RecordingActions, synthetic_snapshot

RANKS = 16
THREADS = 100
PUBLISH_INTERVAL_S = 0.1


# -- client side (a subprocess) -------------------------------------------------


async def _load(url: str, requests: int, clients: int) -> list[float]:
    latencies: list[float] = []
    per_client = max(1, requests // clients)
    async with ClientSession(connector=TCPConnector(limit=clients)) as session:

        async def client() -> None:
            for _ in range(per_client):
                t0 = time.perf_counter()
                async with session.get(url) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                latencies.append(time.perf_counter() - t0)

        # Warm-up: open every connection and fill the caches once.
        await asyncio.gather(*(session.get(url) for _ in range(clients)))
        latencies.clear()
        await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


def _client_main(url: str, requests: int, clients: int) -> None:
    latencies = asyncio.run(_load(url, requests, clients))
    print(json.dumps(latencies))


# -- server side -------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _publish(store: StateStore) -> None:
    while True:
        await asyncio.sleep(PUBLISH_INTERVAL_S)
        c = store.snapshot.counters
        store.update(counters=replace(c, checks=c.checks + 1, last_check_at=time.time()))


async def _measure(url: str, requests: int, clients: int) -> dict[str, float]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.bench.api_bench",
        "--client",
        url,
        "--requests",
        str(requests),
        "--clients",
        str(clients),
        stdout=subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"client for {url} failed with {proc.returncode}")
    lat = json.loads(out)
    return {
        "n": len(lat),
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * _percentile(lat, 0.99),
    }


async def _bench(requests: int, clients: int) -> list[tuple[str, dict[str, float]]]:
    snap = synthetic_snapshot(RANKS, THREADS)
    store = StateStore(snap)
    actions = RecordingActions(tuple(r.rank for r in snap.placement.ranks))
    cached = ApiServer(store, actions, ApiConfig(listen="127.0.0.1:0"))
    uncached = ApiServer(store, actions, ApiConfig(listen="127.0.0.1:0"))

    small = json.dumps({"status": 200, "ready": True}).encode()
    # The same number of bytes as /placement: what is left of the gap between
    # this and /placement is the handler; the rest is moving a bigger body.
    large = json.dumps(placement_doc(snap)).encode()

    async def bare_handler(request: web.Request) -> web.Response:
        return web.Response(body=small, content_type="application/json")

    async def bare_large_handler(request: web.Request) -> web.Response:
        return web.Response(body=large, content_type="application/json")

    bare_app = web.Application()
    bare_app.router.add_get("/bare", bare_handler)
    bare_app.router.add_get("/bare-large", bare_large_handler)
    bare_runner = web.AppRunner(bare_app, handle_signals=False, access_log=None)
    await bare_runner.setup()
    bare_site = web.TCPSite(bare_runner, "127.0.0.1", 0)
    await bare_site.start()
    bare_port = bare_runner.addresses[0][1]

    await cached.start()
    await uncached.start()
    publisher = asyncio.create_task(_publish(store))
    results: list[tuple[str, dict[str, float]]] = []
    try:
        cases = [
            ("bare /bare (baseline)", f"http://127.0.0.1:{bare_port}/bare"),
            ("bare, /placement's size", f"http://127.0.0.1:{bare_port}/bare-large"),
            ("/placement cached", f"http://{cached.addresses[0]}/placement"),
            ("/metrics cached", f"http://{cached.addresses[0]}/metrics"),
            ("/placement uncached", f"http://{uncached.addresses[0]}/placement"),
            ("/metrics uncached", f"http://{uncached.addresses[0]}/metrics"),
        ]
        for name, url in cases:
            results.append((name, await _measure(url, requests, clients)))
    finally:
        publisher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await publisher
        await cached.stop()
        await uncached.stop()
        await bare_runner.cleanup()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="API latency benchmark")
    parser.add_argument("--requests", type=int, default=10000)  # p99 = the 100th slowest
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        _client_main(args.client, args.requests, args.clients)
        return 0
    snap = synthetic_snapshot(RANKS, THREADS)
    placement_bytes = len(json.dumps(placement_doc(snap)))
    print(
        f"api_bench: {RANKS} ranks x {THREADS} threads (+ engine), /placement body "
        f"{placement_bytes // 1024} KiB, new snapshot every {PUBLISH_INTERVAL_S * 1000:.0f} ms, "
        f"{args.clients} concurrent clients, {args.requests} requests per case"
    )
    results = asyncio.run(_bench(args.requests, args.clients))
    base = results[0][1]
    print(f"{'case':<26} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'p50 x':>6} {'p99 x':>6}")
    for name, r in results:
        print(
            f"{name:<26} {r['n']:>5.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{r['p50_ms'] / base['p50_ms']:>6.2f} {r['p99_ms'] / base['p99_ms']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
