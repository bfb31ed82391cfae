"""Metric families declared over named snapshot inputs, rendered incrementally (no I/O).

A family is a function `fill(metric, <input>, ...)` registered on a
`FamilyTable`. Its parameter names after the first ARE its inputs: each
names a field of `Snapshot` or of `Snapshot.counters` (`INPUTS`), and the
function receives those values and nothing else, so it cannot read a field
it did not declare. What the renderer depends on is therefore derived from
the functions themselves, never listed beside them.

`MetricsRenderer` keeps each family's `Metric` and its text per exposition
format, and builds or formats a family again only when one of its inputs is
a new value: a check that moves `last_check_at` re-renders two one-line
families, not 500 pre-initialised counter series.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Literal, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from supervisor.state import Counters, Snapshot, StateStore

MetricKind = Literal["gauge", "counter", "info", "summary"]
Encoder = Callable[[Collector], bytes]
Fill = TypeVar("Fill", bound=Callable[..., None])

# Each takes (name, documentation, labels=...); Metric itself takes a type instead.
_METRIC_CLASSES: dict[MetricKind, Callable[..., Metric]] = {
    "gauge": GaugeMetricFamily,
    "counter": CounterMetricFamily,
    "info": InfoMetricFamily,
    "summary": SummaryMetricFamily,
}
# Kept this many exposition formats (content types) at once: the Accept
# header picks one, and a client must not grow the cache without bound.
FORMATS_KEPT = 4


def _inputs() -> dict[str, Callable[[Snapshot], object]]:
    getters: dict[str, Callable[[Snapshot], object]] = {
        f.name: attrgetter(f.name) for f in fields(Snapshot)
    }
    for f in fields(Counters):
        assert f.name not in getters, f"Counters.{f.name} shadows Snapshot.{f.name}"
        getters[f.name] = attrgetter(f"counters.{f.name}")
    return getters


INPUTS: dict[str, Callable[[Snapshot], object]] = _inputs()
"""Every input a family may declare: Snapshot's fields, then Counters' fields by name."""


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: its name, kind, help and label names, and how to fill it."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...]
    fill: Callable[..., None]
    inputs: tuple[str, ...]  # the parameter names of `fill` after the metric

    def empty(self) -> Metric:
        """The family with no samples (what `describe()` answers)."""
        return _METRIC_CLASSES[self.kind](self.name, self.help, labels=self.labels)

    def values(self, snap: Snapshot) -> tuple[object, ...]:
        return tuple(INPUTS[name](snap) for name in self.inputs)

    def build(self, values: tuple[object, ...]) -> Metric:
        metric = self.empty()
        self.fill(metric, *values)
        return metric


class FamilyTable:
    """The families of one exposition, in the order they are exposed.

    `@table.add(kind, name, help, labels)` registers a fill function; an
    input name that is no snapshot field fails at import, naming it.
    """

    def __init__(self) -> None:
        self._families: list[Family] = []

    def add(
        self, kind: MetricKind, name: str, help: str, labels: Sequence[str] = ()
    ) -> Callable[[Fill], Fill]:
        def register(fill: Fill) -> Fill:
            params = list(inspect.signature(fill).parameters)[1:]
            unknown = [p for p in params if p not in INPUTS]
            if unknown:
                raise TypeError(
                    f"metric family {name}: {fill.__name__} takes {', '.join(unknown)}, "
                    f"which is no Snapshot or Counters field (known: {', '.join(INPUTS)})"
                )
            if any(f.name == name for f in self._families):
                raise TypeError(f"metric family {name} is registered twice")
            self._families.append(Family(name, kind, help, tuple(labels), fill, tuple(params)))
            return fill

        return register

    def __iter__(self) -> Iterator[Family]:
        return iter(self._families)

    def __len__(self) -> int:
        return len(self._families)


def _same(old: tuple[object, ...], new: tuple[object, ...]) -> bool:
    # `is` for the immutable mappings and dataclasses a new snapshot carries
    # over; `==` for plain numbers, which are new objects even when equal.
    return all(
        a is b or (type(a) is type(b) and isinstance(a, (int, float, str)) and a == b)
        for a, b in zip(old, new, strict=True)
    )


class _One(Collector):
    """One metric as a Collector: what an encoder takes."""

    def __init__(self, metrics: Sequence[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self._metrics


@dataclass(slots=True)
class _Format:
    """The cached text of one exposition format (one content type)."""

    encoder: Encoder
    trailer: bytes  # what the encoder writes after the last family ("# EOF\n" or b"")
    texts: dict[str, tuple[Metric, bytes]]
    last: tuple[Snapshot, bytes] | None = None


class MetricsRenderer:
    """Builds each family's Metric, and its text, again only when its inputs changed.

    `built` counts builds per family name (tests read it). Holding the input
    values keeps `is` sound: no new object can reuse a held one's address.
    """

    def __init__(self, families: Iterable[Family]) -> None:
        self.families = tuple(families)
        self.built: dict[str, int] = dict.fromkeys((f.name for f in self.families), 0)
        self._metrics: dict[str, tuple[tuple[object, ...], Metric]] = {}
        self._formats: dict[str, _Format] = {}

    def metrics(self, snap: Snapshot) -> list[Metric]:
        out: list[Metric] = []
        for family in self.families:
            values = family.values(snap)
            hit = self._metrics.get(family.name)
            if hit is None or not _same(hit[0], values):
                hit = (values, family.build(values))
                self._metrics[family.name] = hit
                self.built[family.name] += 1
            out.append(hit[1])
        return out

    def _format(self, content_type: str, encoder: Encoder) -> _Format:
        fmt = self._formats.get(content_type)
        if fmt is None:
            if len(self._formats) >= FORMATS_KEPT:
                del self._formats[next(iter(self._formats))]
            fmt = _Format(encoder, encoder(_One(())), {})
            self._formats[content_type] = fmt
        return fmt

    def exposition(self, snap: Snapshot, encoder: Encoder, content_type: str) -> bytes:
        """What `encoder(registry)` would answer, from the families' cached text."""
        fmt = self._format(content_type, encoder)
        if fmt.last is not None and fmt.last[0] is snap:
            return fmt.last[1]
        parts: list[bytes] = []
        cut = len(fmt.trailer)
        for metric in self.metrics(snap):
            hit = fmt.texts.get(metric.name)
            if hit is None or hit[0] is not metric:
                text = fmt.encoder(_One((metric,)))
                hit = (metric, text[: len(text) - cut])
                fmt.texts[metric.name] = hit
            parts.append(hit[1])
        parts.append(fmt.trailer)
        body = b"".join(parts)
        fmt.last = (snap, body)
        return body


class SnapshotCollector(Collector):
    """Renders `store.snapshot` through a `MetricsRenderer`: what the daemon's registry holds."""

    def __init__(self, store: StateStore, families: Iterable[Family]) -> None:
        self._store = store
        self.renderer = MetricsRenderer(families)

    def describe(self) -> Iterable[Metric]:
        # Names only: registration must not depend on what the snapshot holds.
        return [f.empty() for f in self.renderer.families]

    def collect(self) -> Iterable[Metric]:
        return self.renderer.metrics(self._store.snapshot)

    def exposition(self, encoder: Encoder, content_type: str) -> bytes:
        """The /metrics body for the current snapshot in `content_type`."""
        return self.renderer.exposition(self._store.snapshot, encoder, content_type)
