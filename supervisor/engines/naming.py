"""Which rank an engine-tree process is, all sources together; when silence is a bug (pure).

`decide_rank` joins `rank_from` (when configured), the engine kind's own
rules (supervisor.engines.kind_rules) and the device a process holds open:
when a device is known, its rank wins over a title and the verdict says
which rule disagreed (DESIGN 3.6). `waiting_warnings` picks the ranks still
waiting long after the engine started while its tree shows processes the
kind expects to be ranks (or any titled process) and none matched.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from supervisor.engines.kind_rules import KindRules, title_of
from supervisor.engines.rank_source import ProcFacts, RankSource, device_indexes, resolve_rank


@dataclass(frozen=True, slots=True)
class Verdict:
    """What all the sources say of one process."""

    rank: int | None
    expected: bool  # the kind expects it to be a rank (every process, without a kind)
    rule: str  # the rule that named it, or the one that expected a rank and did not match
    title: str  # the process title (first word of its command line)
    # A title rule named `title_rank`, its device said `rank`: the device won.
    title_rank: int | None = None
    known: bool = False  # one of the engine's own processes that is never a rank

    @property
    def disagreed(self) -> bool:
        return self.title_rank is not None and self.title_rank != self.rank


def device_rank(
    facts: ProcFacts,
    device_ranks: Mapping[int, int],
    number_ranks: Mapping[tuple[int, int], int] | None = None,
) -> int | None:
    """The rank whose device `facts`' process holds open; None: none, or several.

    By the device numbers it holds (`number_ranks`, from the driver's own
    tables: supervisor.topology.device_minors) where they name any, else by
    the node names' numbers (/dev/nvidia3: device 3)."""
    if number_ranks:
        ranks = {number_ranks[n] for n in facts.open_devices if n in number_ranks}
        if ranks:
            return ranks.pop() if len(ranks) == 1 else None
    ranks = {device_ranks[i] for i in device_indexes(facts.open_files) if i in device_ranks}
    return ranks.pop() if len(ranks) == 1 else None


def decide_rank(
    sources: Sequence[RankSource],
    rules: KindRules | None,
    facts: ProcFacts,
    *,
    local_ranks: Mapping[int, int],
    device_ranks: Mapping[int, int],
    number_ranks: Mapping[tuple[int, int], int] | None = None,
) -> Verdict:
    """The rank of a process: `rank_from` when configured, else the kind's rules;
    the device it holds open, when known, wins over either (pure)."""
    title = title_of(facts.cmdline)
    naming = rules.name(facts) if rules is not None else None
    expected = naming.expected if naming is not None else True
    by_device = device_rank(facts, device_ranks, number_ranks) if facts.open_files else None
    if sources:
        named = resolve_rank(sources, facts, local_ranks=local_ranks, device_ranks=device_ranks)
        rule = "rank_from = [" + ", ".join(str(s) for s in sources) + "]"
        if named is not None:
            expected = True
    elif naming is not None and naming.expected:
        rule = naming.rule
        named = None if naming.local_rank is None else local_ranks.get(naming.local_rank)
    elif rules is None:
        return Verdict(None, True, "none", title)  # nothing names ranks: every process counts
    else:
        return Verdict(
            None, False, rules.describe(), title, known=naming is not None and naming.known
        )
    if by_device is not None and (expected or named is not None):
        if named is not None and named != by_device:
            return Verdict(by_device, True, rule, title, title_rank=named)
        return Verdict(by_device, True, rule if named is not None else "device", title)
    return Verdict(named, expected, rule, title)


@dataclass(frozen=True, slots=True)
class WaitingWarning:
    """A rank still waiting: what its WARNING names."""

    rank: int
    waited_s: float
    rule: str
    titles: tuple[str, ...]  # the titles seen in the engine's tree (at most TITLES_SHOWN)


TITLES_SHOWN = 8


def waiting_warnings(
    *,
    waited_s: float,
    threshold_s: float,
    waiting: Collection[int],
    warned: Collection[int],
    seen: Sequence[Verdict],
    titled: Collection[str],
    rule: str,
) -> list[WaitingWarning]:
    """Ranks to warn about now (pure): still waiting `threshold_s` after the engine
    started (`waited_s`), not warned yet, while the engine's unadopted processes
    (`seen`) hold one the kind expects to be a rank, or any with a title
    (`titled`), and none was named. Titles are listed once each, in tree order."""
    if waited_s < threshold_s:
        return []
    titles: list[str] = []
    for v in seen:
        if (v.expected or v.title in titled) and v.title not in titles:
            titles.append(v.title)
    if not titles:
        return []
    shown = tuple(titles[:TITLES_SHOWN])
    return [
        WaitingWarning(rank, waited_s, rule, shown)
        for rank in sorted(waiting)
        if rank not in warned
    ]
