"""The pure half of a config reload: what needs a restart, which processes respawn."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import load_config_digest, parse_config
from supervisor.daemon.reload import process_change, respawn_keys, restart_reasons
from supervisor.examples.hosts import no_accel_2node
from supervisor.hostfs import HostFS
from supervisor.plan.placement import Slot
from supervisor.plan.planner import plan
from supervisor.run.spec import ChildSpec, build_specs
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions
from supervisor.worker import SLOT_ENV

BASE: dict[str, Any] = {
    "cpu_ranks": 2,
    "workers": {"command": ["w", "{rank}"]},
    "engine": {"command": ["e"]},
}


def config(**changes: Any) -> Any:
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key].update(value)
        else:
            doc[key] = value
    return parse_config(doc, "c.toml")


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"api": {"listen": "127.0.0.1:9999"}}, "[api]"),
        ({"cgroup": "off"}, "cgroup"),
        ({"irq": {"enabled": False}}, "[irq]"),
    ],
)
def test_what_cannot_change_live_is_named(changes: dict[str, Any], reason: str) -> None:
    assert restart_reasons(config(), config(**changes)) == (reason,)


def test_who_spawns_the_workers_cannot_change_live() -> None:
    adopted = {"spawned_by": "engine", "rank_from": ["env:LOCAL_RANK"]}
    new = parse_config({**BASE, "workers": adopted}, "c.toml")
    assert restart_reasons(config(), new) == ("workers.spawned_by",)


def test_what_can_change_live_needs_no_restart() -> None:
    new = config(
        workers={"env": {"A": "1"}},
        restart={"backoff_max_s": 5.0},
        drift={"check_interval_s": 0.5},
        placement={"rank_roles": {"comm": 1}},
    )
    assert restart_reasons(config(), new) == ()


def spec(key: Any, **changes: Any) -> ChildSpec:
    base = ChildSpec(key, ("w",), {"A": "1", SLOT_ENV: "slot-a"}, None)  # type: ignore[arg-type]
    return replace(base, **changes)


def test_respawn_on_command_env_or_account_but_not_on_the_slot_alone() -> None:
    old = {"engine": spec("engine"), 0: spec(0), 1: spec(1), 2: spec(2)}
    new = {
        "engine": spec("engine", env={"A": "1", SLOT_ENV: "slot-b"}),  # slot only
        0: spec(0, argv=("w", "--new")),
        1: spec(1, env={"A": "2", SLOT_ENV: "slot-a"}),
        2: spec(2),
    }
    assert respawn_keys(old, new) == (0, 1)
    new["engine"] = spec("engine", argv=("e", "--new"))
    assert respawn_keys(old, new, adopted=True) == ("engine",)  # its workers come with it


def test_respawn_on_new_cpus_or_nodes_but_not_on_new_roles_alone() -> None:
    slot = Slot((0, 1), (0,), {"main": (0, 1)})
    old = {0: spec(0, slot=slot), 1: spec(1, slot=slot), 2: spec(2, slot=slot)}
    new = {
        0: spec(0, slot=Slot((0,), (0,), {"main": (0,)})),  # fewer CPUs
        1: spec(1, slot=Slot((0, 1), (1,), {"main": (0, 1)})),  # another node
        2: spec(2, slot=Slot((0, 1), (0,), {"main": (0,), "comm": (1,)})),  # roles only
    }
    assert respawn_keys(old, new) == (0, 1)


def test_env_change_in_workers_respawns_the_workers_only(tmp_path: Path) -> None:
    fs = HostFS(str(no_accel_2node(tmp_path)))
    topology = read_topology(fs, DiscoveryOptions(cpu_ranks=2))
    old_cfg, new_cfg = config(), config(workers={"env": {"A": "2"}})
    placement = plan(topology, old_cfg.placement)
    old = {s.key: s for s in build_specs(old_cfg, placement, {}, "py", 1)}
    new = {s.key: s for s in build_specs(new_cfg, placement, {}, "py", 1)}
    assert respawn_keys(old, new) == (0, 1)
    assert process_change(placement, placement) is None
    more = plan(read_topology(fs, DiscoveryOptions(cpu_ranks=4)), old_cfg.placement)
    assert process_change(placement, more) == "the new plan has 5 processes, 3 run now"


def test_the_digest_is_the_sha256_of_the_file_bytes(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('cpu_ranks = 2\n[workers]\ncommand = ["w"]\n')
    cfg, digest = load_config_digest(str(path))
    assert cfg.cpu_ranks == 2 and digest == hashlib.sha256(path.read_bytes()).hexdigest()


# -- what the running daemon fixed at start: refused, never reloaded `ok` (issue 30 item 5) --


def test_an_engine_kind_change_is_refused() -> None:
    assert restart_reasons(config(), config(engine={"kind": "torchrun"})) == (
        "engine.kind (custom -> torchrun)",
    )


def test_the_fast_cpuset_watch_period_is_refused() -> None:
    assert restart_reasons(config(), config(drift={"cpuset_watch_s": 0.0})) == (
        "drift.cpuset_watch_s",
    )


def _adopted(engine: list[str], **workers: Any) -> Any:
    doc = {
        **BASE,
        "engine": {"command": engine},
        "workers": {"spawned_by": "engine", **workers},
    }
    return parse_config(doc, "c.toml")


def test_what_the_adopter_reads_from_the_engine_command_is_refused() -> None:
    old = _adopted(["vllm", "serve", "m", "--tensor-parallel-size", "2"])
    new = _adopted(["vllm", "serve", "m", "--tensor-parallel-size", "1"])
    assert restart_reasons(old, new) == ("engine.command (the layout its kind reads from it)",)
    # A flag the layout does not read is applied (the engine restarts with it).
    same = _adopted(["vllm", "serve", "m", "--tensor-parallel-size", "2", "--port", "9"])
    assert restart_reasons(old, same) == ()


def test_the_adopters_waiting_warning_is_refused() -> None:
    old = _adopted(["vllm", "serve", "m"])
    new = _adopted(["vllm", "serve", "m"], waiting_warning_s=5.0)
    assert restart_reasons(old, new) == ("workers.waiting_warning_s",)


def test_adopted_ranks_given_other_local_ranks_are_refused(tmp_path: Path) -> None:
    # The adopter names the engine's workers by (local rank, device) tables made
    # from the plan at start: a plan that renames the ranks cannot go in force live.
    fs = HostFS(str(no_accel_2node(tmp_path)))
    placement = plan(read_topology(fs, DiscoveryOptions(cpu_ranks=2)), config().placement)
    first, second = placement.ranks
    swapped = replace(
        placement,
        ranks=(
            replace(first, local_rank=second.local_rank),
            replace(second, local_rank=first.local_rank),
        ),
    )
    assert process_change(placement, swapped) is None  # spawned workers: applied
    assert process_change(placement, swapped, adopted=True) == (
        "the new plan gives the adopted ranks other devices or local ranks"
    )
    assert process_change(placement, placement, adopted=True) is None
