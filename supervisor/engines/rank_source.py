"""Which rank an engine-spawned process is: the `rank_from` sources (pure, no I/O).

`env:NAME` (the integer value of NAME in its environment), `cmdline:REGEX`
(group 1 of a search in its command line, words joined by single spaces:
setproctitle rewrites it, and comm is cut at 15 bytes), `device` (the
accelerator device node it holds open). docs/contracts.md §6.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from supervisor.plan.placement import Placement
from supervisor.topology.accelerators import CPU, device_index

SourceKind = Literal["env", "cmdline", "device"]


@dataclass(frozen=True, slots=True)
class RankSource:
    """One `rank_from` item: env:NAME, cmdline:REGEX or device."""

    kind: SourceKind
    name: str = ""  # env: the variable
    pattern: re.Pattern[str] | None = None  # cmdline: group 1 is the rank

    def __str__(self) -> str:
        if self.kind == "env":
            return f"env:{self.name}"
        if self.kind == "cmdline":
            assert self.pattern is not None
            return f"cmdline:{self.pattern.pattern}"
        return "device"


def parse_rank_source(text: str) -> RankSource:
    """Parse one `rank_from` item; ValueError says what is wrong (pure)."""
    kind, sep, rest = text.partition(":")
    if text == "device":
        return RankSource("device")
    if kind == "env" and sep:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rest):
            raise ValueError(f"env:NAME needs a variable name, got {text!r}")
        return RankSource("env", name=rest)
    if kind == "cmdline" and sep:
        try:
            pattern = re.compile(rest)
        except re.error as err:
            raise ValueError(f"{text!r}: not a regular expression: {err}") from None
        if pattern.groups < 1:
            raise ValueError(f"{text!r}: the regex needs a group that captures the rank, as (\\d+)")
        return RankSource("cmdline", pattern=pattern)
    raise ValueError(f"expected env:NAME, cmdline:REGEX or device, got {text!r}")


@dataclass(frozen=True, slots=True)
class ProcFacts:
    """What the sources look at in one process."""

    environ: Mapping[str, str]
    cmdline: str  # words joined by single spaces
    open_files: tuple[str, ...] = ()  # readlink of /proc/<pid>/fd/*
    # (major, minor) of the character devices among them (stat of the fd): the
    # number says which device it is where a container renamed the node.
    open_devices: tuple[tuple[int, int], ...] = ()


def device_indexes(open_files: Sequence[str]) -> list[int]:
    """Accelerator device indexes of the device nodes among `open_files` (pure):
    each kind's `device_nodes` (accelerators), e.g. the NVIDIA minor number."""
    found = (device_index(path) for path in open_files)
    return sorted({i for i in found if i is not None})


def resolve_rank(
    sources: Sequence[RankSource],
    facts: ProcFacts,
    *,
    local_ranks: Mapping[int, int],
    device_ranks: Mapping[int, int],
) -> int | None:
    """The rank of a process: the first source that names one (pure).

    env and cmdline give a local rank (its index among the visible devices, as
    LOCAL_RANK is), `local_ranks` maps it to the rank; device gives a device
    index, `device_ranks` maps it. A source that gives no integer, or one
    that names no planned rank, passes to the next.
    """
    for source in sources:
        rank: int | None = None
        if source.kind == "env":
            rank = _integer(facts.environ.get(source.name), local_ranks)
        elif source.kind == "cmdline":
            assert source.pattern is not None
            m = source.pattern.search(facts.cmdline)
            rank = _integer(m.group(1) if m else None, local_ranks)
        else:
            ranks = {device_ranks[i] for i in device_indexes(facts.open_files) if i in device_ranks}
            rank = ranks.pop() if len(ranks) == 1 else None  # several: ambiguous, not ours to pick
        if rank is not None:
            return rank
    return None


def _integer(text: str | None, table: Mapping[int, int]) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not text.isdigit():
        return None
    return table.get(int(text))


def bdf_ranks(placement: Placement) -> dict[str, int]:
    """{PCI address: rank} of the plan's accelerators (pure)."""
    return {
        d.bus_id.lower(): r.rank
        for r in placement.ranks
        for d in r.all_devices
        if d.kind != CPU.name and d.bus_id
    }


def rank_tables(placement: Placement) -> tuple[dict[int, int], dict[int, int]]:
    """(local rank -> rank, device index -> rank) of the plan (pure)."""
    local = {r.local_rank: r.rank for r in placement.ranks}
    devices = {
        d.index: r.rank for r in placement.ranks for d in r.all_devices if d.kind != CPU.name
    }
    return local, devices
