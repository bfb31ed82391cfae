"""supervisor.worker: a real ThreadPoolExecutor names and binds its OS threads."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from supervisor import worker
from supervisor.plan.placement import Slot


def _comm(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def _run_pool(size: int, initializer: Callable[[], None]) -> list[tuple[int, str, set[int]]]:
    """Start every thread of a pool (a barrier holds each task until all run)."""
    barrier = threading.Barrier(size, timeout=30)

    def probe() -> tuple[int, str, set[int]]:
        barrier.wait()
        tid = threading.get_native_id()
        return tid, _comm(tid), os.sched_getaffinity(tid)

    with ThreadPoolExecutor(max_workers=size, initializer=initializer) as pool:
        return list(pool.map(lambda _: probe(), range(size)))


@pytest.fixture
def role_cpus() -> list[int]:
    """A strict subset of what this process may use, so binding is visible."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs at least 2 allowed CPUs to see a bind")
    return allowed[-1:]


def test_pool_threads_named_and_bound(
    monkeypatch: pytest.MonkeyPatch, role_cpus: list[int]
) -> None:
    main_cpus = sorted(os.sched_getaffinity(0))
    slot = Slot(
        tuple(main_cpus), (0,), {"main": tuple(main_cpus[:1]), "so_compiler": tuple(role_cpus)}
    )
    monkeypatch.setenv(worker.SLOT_ENV, worker.slot_env_value("engine", slot.to_doc()))
    before = os.sched_getaffinity(0)

    assert worker.pool_size("so_compiler") == len(role_cpus)
    assert worker.cpus("so_compiler") == role_cpus
    results = _run_pool(3, worker.pool_initializer("so_compiler", "so-compile"))

    assert sorted(name for _, name, _ in results) == [
        "so-compile-0",
        "so-compile-1",
        "so-compile-2",
    ]
    for _tid, _name, affinity in results:
        assert affinity == set(role_cpus)
    # Only the pool's threads moved, not the calling (main) thread.
    assert os.sched_getaffinity(0) == before


def test_default_prefix_is_role_name(monkeypatch: pytest.MonkeyPatch, role_cpus: list[int]) -> None:
    slot = Slot(
        tuple(role_cpus), (0,), {"main": tuple(role_cpus), "mm_preprocess": tuple(role_cpus)}
    )
    monkeypatch.setenv(worker.SLOT_ENV, worker.slot_env_value(0, slot.to_doc()))
    results = _run_pool(1, worker.pool_initializer("mm_preprocess"))
    assert results[0][1] == "mm-preprocess-0"
    assert worker.current_slot() == worker.WorkerSlot(
        "0",
        0,
        tuple(role_cpus),
        (0,),
        {"main": tuple(role_cpus), "mm_preprocess": tuple(role_cpus)},
    )


def test_unknown_role_falls_back_to_main(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = {"cpus": [0, 1, 2], "mems": [0], "roles": {"main": [0, 1], "irq": [2]}}
    monkeypatch.setenv(worker.SLOT_ENV, worker.slot_env_value(3, doc))
    assert worker.cpus("so_compiler") == [0, 1]
    assert worker.cpus() == [0, 1]
    assert worker.pool_size("so_compiler", default=64) == 2
    assert json.loads(os.environ[worker.SLOT_ENV])["rank"] == 3


def test_without_supervisor_names_but_binds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(worker.SLOT_ENV, raising=False)
    before = os.sched_getaffinity(0)
    assert worker.cpus("so_compiler") is None
    assert worker.pool_size("so_compiler", default=4) == 4
    assert worker.pool_size("so_compiler") == len(before)
    results = _run_pool(2, worker.pool_initializer("so_compiler"))
    assert sorted(name for _, name, _ in results) == ["so-compiler-0", "so-compiler-1"]
    assert all(affinity == before for _, _, affinity in results)


def test_bad_json_warns_and_binds_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(worker.SLOT_ENV, "{not json")
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.WARNING, logger="placement_supervisor.worker"):
        assert worker.cpus("so_compiler") is None
        results = _run_pool(2, worker.pool_initializer("so_compiler", "so-compile"))
    assert all(affinity == before for _, _, affinity in results)
    assert sorted(name for _, name, _ in results) == ["so-compile-0", "so-compile-1"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per distinct value, not once per call
    assert worker.SLOT_ENV in warnings[0]
    assert "not valid JSON" in warnings[0]


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ('{"key": "engine", "rank": null, "cpus": [1, -2]}', "cpus"),
        ('{"key": "0", "rank": "zero", "cpus": [1]}', "rank"),
        ('{"key": "0", "rank": 0, "cpus": [1], "roles": {"main": "1-3"}}', "roles.main"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_fields_named(value: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        worker.parse_slot_env(value)


def test_thread_name_truncated_to_15_bytes() -> None:
    def name_and_read() -> str:
        worker.set_thread_name("a-very-long-thread-name-indeed")
        return _comm(threading.get_native_id())

    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(name_and_read).result() == "a-very-long-thr"


def test_unbindable_cpus_warn_not_raise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A CPU far outside the host: sched_setaffinity fails with EINVAL.
    doc = {"cpus": [4095], "mems": [0], "roles": {"main": [4095]}}
    monkeypatch.setenv(worker.SLOT_ENV, worker.slot_env_value("engine", doc))
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.WARNING, logger="placement_supervisor.worker"):
        results = _run_pool(1, worker.pool_initializer("main", "engine-main"))
    assert results[0][1:] == ("engine-main-0", before)
    assert any("bind failed" in r.getMessage() for r in caplog.records)


def test_importable_standalone_without_third_party() -> None:
    """An engine imports it with nothing but the stdlib on its path."""
    code = (
        "import sys; sys.modules['psutil'] = None; sys.modules['aiohttp'] = None;"
        "import supervisor.worker as w; print(w.pool_size('so_compiler', default=3))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env={k: v for k, v in os.environ.items() if k != worker.SLOT_ENV},
    )
    assert out.stdout.strip() == "3"
