"""Demo engine: a stand-in for an inference engine's host process (CPU work; I/O: a TCP port).

`python -m supervisor.demo.engine --port 9478` runs what makes an engine's
CPU placement matter: a structured-output compiler thread pool (threads named
`so-compile-N`, sized and bound from the supervisor's plan through
`supervisor.worker`) that compiles grammar-like regexes and builds a token
trie over a synthetic vocabulary in bursts, and a tokenizer-like main loop.
It listens on a TCP port so the supervisor's readiness probe can see it up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import uvloop

from supervisor import worker as slot_helper
from supervisor.demo.worker import placement_line
from supervisor.hostfs import HostFS

_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def synthetic_vocabulary(size: int, seed: int) -> list[str]:
    """`size` distinct word pieces, 1 to 8 letters, deterministic for a seed."""
    rng = random.Random(seed)
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 8))))
    return sorted(vocab)


def build_trie(vocab: list[str]) -> dict[str, object]:
    """A nested-dict prefix trie, as a grammar compiler builds over the vocabulary."""
    root: dict[str, object] = {}
    for token in vocab:
        node = root
        for ch in token:
            child = node.get(ch)
            if child is None:
                child = {}
                node[ch] = child
            assert isinstance(child, dict)
            node = child
        node["$"] = token
    return root


def compile_grammar(job: int, vocab: list[str]) -> int:
    """One compile: a fresh JSON-schema-like regex and the tokens it can start with."""
    rng = random.Random(job)
    keys = rng.sample(vocab[:200], 4)
    pattern = (
        r"\{\s*"
        + r"\s*,\s*".join(rf'"{k}"\s*:\s*(?:"[a-z]{{0,{rng.randint(4, 16)}}}"|\d+)' for k in keys)
        + r"\s*\}"
    )
    compiled = re.compile(pattern)  # a distinct pattern each time: no re cache hit
    trie = build_trie(vocab)
    allowed = sum(1 for ch in trie if compiled.pattern.find(ch) >= 0)
    return allowed + len(compiled.pattern)


def tokenize(text: str, vocab_set: frozenset[str]) -> int:
    """Greedy longest-match tokenization, roughly what a BPE merge loop costs."""
    count = 0
    for word in text.split():
        i = 0
        while i < len(word):
            for j in range(min(len(word), i + 8), i, -1):
                if word[i:j] in vocab_set or j == i + 1:
                    count += 1
                    i = j
                    break
    return count


async def handle_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"ok\n")
    try:
        await writer.drain()
    finally:
        writer.close()


async def run(args: argparse.Namespace) -> int:
    fs = HostFS("/")
    print(placement_line("engine", fs), flush=True)
    vocab = synthetic_vocabulary(args.vocab_size, seed=1)
    vocab_set = frozenset(vocab)
    pool_size = slot_helper.pool_size("so_compiler", 4)
    pool = ThreadPoolExecutor(
        max_workers=pool_size,
        initializer=slot_helper.pool_initializer("so_compiler", "so-compile"),
    )
    loop = asyncio.get_running_loop()
    # Start every pool thread now (the executor creates them lazily), so the
    # supervisor sees all `so-compile-N` threads from the start.
    await asyncio.gather(
        *(loop.run_in_executor(pool, compile_grammar, n, vocab) for n in range(pool_size))
    )
    server = await asyncio.start_server(handle_client, args.host, args.port)
    print(
        f"engine listening host={args.host} port={args.port} so_compiler_threads={pool_size}",
        flush=True,
    )
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    rng = random.Random(2)
    job = pool_size
    next_burst = time.monotonic()
    next_report = time.monotonic() + args.report_interval_s
    text = " ".join(rng.choice(vocab) + rng.choice(vocab) for _ in range(300))
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_burst:
            jobs = [
                loop.run_in_executor(pool, compile_grammar, job + i, vocab)
                for i in range(args.burst_jobs)
            ]
            job += args.burst_jobs
            await asyncio.gather(*jobs)
            next_burst = now + args.burst_interval_s
        tokenize(text, vocab_set)
        if now >= next_report:
            print(placement_line("engine", fs) + f" compiled={job}", flush=True)
            next_report = now + args.report_interval_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.step_s)
    server.close()
    await server.wait_closed()
    pool.shutdown(wait=False, cancel_futures=True)
    print(f"stopped engine compiled={job}", flush=True)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m supervisor.demo.engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9478)
    p.add_argument("--vocab-size", type=int, default=3000)
    p.add_argument("--burst-jobs", type=int, default=4, help="compiles per burst")
    p.add_argument("--burst-interval-s", type=float, default=2.0)
    p.add_argument("--step-s", type=float, default=0.1, help="main loop period")
    p.add_argument("--report-interval-s", type=float, default=10.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    code: int = uvloop.run(run(args))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
