"""supervisor.plan.threads: role matching and the thread verdict (pure; the re-binds
themselves are decided in supervisor.watch.decide: tests/watch/test_decide.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import load_config
from supervisor.plan.keys import ThreadRole
from supervisor.plan.placement import Slot
from supervisor.plan.threads import (
    DEFAULT_THREAD_ROLES,
    RoleMatcher,
    role_for_thread,
    thread_verdict,
    unmatchable_patterns,
)

ROLES = (
    ThreadRole("acl", "workers", "acl_thread*"),
    ThreadRole("release", "workers", "release_thread*"),
    ThreadRole("comm", "workers", "hccl*"),
    ThreadRole("comm", "workers", "NCCL*"),
    ThreadRole("so_compiler", "engine", "so-compile*"),
    ThreadRole("mm", "engine", "mm-*"),
    ThreadRole("catch_all", "workers", "*"),  # after the specific ones: first match wins
)

SLOT = Slot(
    cpus=tuple(range(8)),
    mems=(0,),
    roles={"irq": (0, 1), "main": (2, 3, 4, 5), "acl": (6,), "release": (7,)},
)


@pytest.mark.parametrize(
    ("name", "process", "role"),
    [
        ("acl_thread", "workers", "acl"),
        ("release_thread", "workers", "release"),
        ("NCCL ProxyServ", "workers", "comm"),
        ("nccl proxy", "workers", "catch_all"),  # case-sensitive, like comm bytes
        ("python3", "workers", "catch_all"),
        ("so-compile-3", "engine", "so_compiler"),
        ("so-compile-3", "workers", "catch_all"),  # roles of the other process don't apply
        ("python3", "engine", "main"),
        ("mm-preprocess-0", "engine", "mm"),
    ],
)
def test_role_for_thread(name: str, process: str, role: str) -> None:
    assert role_for_thread(name, process, ROLES) == role  # type: ignore[arg-type]
    assert RoleMatcher(process, ROLES).role(name) == role  # type: ignore[arg-type]


def test_first_match_wins_in_config_order() -> None:
    roles = (ThreadRole("a", "engine", "x*"), ThreadRole("b", "engine", "xy*"))
    assert role_for_thread("xyz", "engine", roles) == "a"
    assert role_for_thread("xyz", "engine", roles[::-1]) == "b"


def test_pattern_matches_the_15_char_comm_only() -> None:
    roles = (ThreadRole("r", "workers", "release_thread_m"),)  # 16 literal chars
    # The kernel keeps "release_thread_" of "release_thread_main".
    assert role_for_thread("release_thread_main", "workers", roles) == "main"
    assert unmatchable_patterns(roles) and "release_thread_" in unmatchable_patterns(roles)[0]
    assert (
        role_for_thread(
            "release_thread_main", "workers", (ThreadRole("r", "workers", "release_thread_*"),)
        )
        == "r"
    )
    assert unmatchable_patterns(ROLES) == []
    assert unmatchable_patterns((ThreadRole("r", "engine", "[abc]" * 15 + "*"),)) == []
    assert unmatchable_patterns((ThreadRole("r", "engine", "?" * 16),)) != []


def test_default_roles_match_the_worker_helper_names() -> None:
    assert role_for_thread("so-compile-0", "engine", DEFAULT_THREAD_ROLES) == "so_compiler"
    assert role_for_thread("so-compiler-12", "engine", DEFAULT_THREAD_ROLES) == "so_compiler"


def test_matcher_memo_is_bounded() -> None:
    matcher = RoleMatcher("workers", ROLES)
    for i in range(RoleMatcher.MEMO_MAX + 10):
        assert matcher.role(f"req-{i}") == "catch_all"
    assert len(matcher._memo) <= RoleMatcher.MEMO_MAX


@pytest.mark.parametrize(
    ("live", "want", "enforce", "verdict"),
    [
        ((2, 3, 4, 5), (2, 3, 4, 5), False, "ok"),
        ((5, 4, 3, 2), (2, 3, 4, 5), False, "ok"),
        ((3,), (2, 3, 4, 5), False, "pinned"),
        ((3,), (2, 3, 4, 5), True, "drift"),
        ((0, 1, 2, 3, 4, 5, 6, 7), (2, 3, 4, 5), False, "drift"),  # wider: the shim's slot
        ((1, 2), (2, 3, 4, 5), False, "drift"),  # partly outside
        ((9,), (2, 3, 4, 5), False, "drift"),
        ((), (2, 3), False, "drift"),
    ],
)
def test_thread_verdict(
    live: tuple[int, ...], want: tuple[int, ...], enforce: bool, verdict: str
) -> None:
    assert thread_verdict(live, want, enforce) == verdict


def test_example_config_roles(repo: Path) -> None:
    cfg = load_config(str(repo / "configs/threads.example.toml"))
    assert unmatchable_patterns(cfg.threads) == []
    assert role_for_thread("so-compile-2", "engine", cfg.threads) == "so_compiler"
    assert role_for_thread("acl_thread", "workers", cfg.threads) == "acl"
    assert role_for_thread("release_thread", "workers", cfg.threads) == "release"
    assert role_for_thread("NCCL Progress 1", "workers", cfg.threads) == "comm"
    assert role_for_thread("python3", "workers", cfg.threads) == "main"
    assert {"acl", "release", "comm", "irq"} <= set(cfg.placement.rank_roles)
