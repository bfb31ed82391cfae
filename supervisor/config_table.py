"""A TOML table being validated: typed getters that name the key path (pure, no I/O).

`Table` reads one table of a parsed document for `supervisor.config`: each
getter checks the type and bounds and raises one ConfigError naming the file
and key ("restart.backoff_max_s"); `done()` rejects keys nobody asked for,
suggesting the nearest known one.
"""

from __future__ import annotations

import difflib
import math
import shlex
from collections.abc import Mapping
from typing import Any, TypeVar

from supervisor.errors import ConfigError

T = TypeVar("T")


class Table:
    """A TOML table being read: typed getters that name the key path on error,
    and `done()` that rejects keys nobody asked for."""

    def __init__(
        self, doc: Mapping[str, Any], path: str, file: str, asked: set[str] | None = None
    ) -> None:
        self.doc = doc
        self.path = path
        self.file = file
        self.seen: set[str] = set()
        self.known: set[str] = set()  # every key asked for, present or not: for suggestions
        # When given (shared with every sub-table): each key path asked for, present
        # or not, in the whole document ("restart.backoff_factor"): config.config_keys.
        self.asked = asked

    def where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.file}: {self.where(key)}: {message}")

    def has(self, key: str) -> bool:
        return self._asked(key)

    def _asked(self, key: str) -> bool:
        """Note `key` as a known key; True when the document holds it."""
        self.known.add(key)
        if self.asked is not None:
            self.asked.add(self.where(key))
        return key in self.doc

    def _get(self, key: str, kinds: tuple[type, ...], expected: str) -> Any:
        self.seen.add(key)
        value = self.doc[key]
        # bool is an int in Python; a TOML `true` is never a number here.
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(key, f"expected {expected}, got {value!r}")
        if not isinstance(value, kinds):
            raise self.fail(key, f"expected {expected}, got {value!r}")
        return value

    def text(self, key: str, default: T) -> str | T:
        if not self._asked(key):
            return default
        value: str = self._get(key, (str,), "a string")
        return value

    def flag(self, key: str, default: bool) -> bool:
        if not self._asked(key):
            return default
        value: bool = self._get(key, (bool,), "true or false")
        return value

    def integer(self, key: str, default: int, minimum: int = 0, maximum: int | None = None) -> int:
        if not self._asked(key):
            return default
        value: int = self._get(key, (int,), "an integer")
        if value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be <= {maximum}, got {value}")
        return value

    def number(
        self, key: str, default: T, minimum: float = 0.0, *, strict: bool = False
    ) -> float | T:
        if not self._asked(key):
            return default
        value = float(self._get(key, (int, float), "a number"))
        if not math.isfinite(value):  # TOML allows nan and inf; no duration is either
            raise self.fail(key, f"must be a finite number, got {value}")
        if value < minimum or (strict and value == minimum):
            bound = ">" if strict else ">="
            raise self.fail(key, f"must be {bound} {minimum}, got {value}")
        return value

    def choice(self, key: str, default: T, choices: tuple[str, ...]) -> T:
        if not self._asked(key):
            return default
        value = self._get(key, (str,), "a string")
        if value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}; got {value!r}")
        return value  # type: ignore[no-any-return]

    def str_list(self, key: str) -> tuple[str, ...]:
        if not self._asked(key):
            return ()
        value = self._get(key, (list,), "a list of strings")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.fail(key, f"item {i} must be a string, got {item!r}")
        return tuple(value)

    def command(self, key: str) -> tuple[str, ...]:
        """A command as a list of strings or one shell-quoted string; required."""
        if not self._asked(key):
            raise self.fail(key, "is required")
        raw = self._get(key, (str, list), "a list of strings or a string")
        if isinstance(raw, str):
            try:
                argv = tuple(shlex.split(raw))
            except ValueError as err:
                raise self.fail(key, f"cannot split {raw!r}: {err}") from None
        else:
            argv = self.str_list(key)
        if not argv or not argv[0]:
            raise self.fail(key, "must not be empty")
        return argv

    def table(self, key: str) -> Table:
        value = self._get(key, (dict,), "a table") if self._asked(key) else {}
        self.seen.add(key)
        return Table(value, self.where(key), self.file, self.asked)

    def str_map(self, key: str) -> dict[str, str]:
        sub = self.table(key)
        out = {name: sub.text(name, "") for name in sub.doc}
        sub.done()
        return out

    def int_map(self, key: str, default: Mapping[str, int]) -> dict[str, int]:
        if not self._asked(key):
            return dict(default)
        sub = self.table(key)
        out = {name: sub.integer(name, 0) for name in sub.doc}
        sub.done()
        return out

    def done(self) -> None:
        unknown = sorted(set(self.doc) - self.seen)
        if unknown:
            raise self.fail(unknown[0], "unknown key" + suggest_key(unknown[0], self.known))


def suggest_key(key: str, known: set[str]) -> str:
    """The "; did you mean `x`?" tail naming the nearest known key, or "" (pure).

    difflib's default cutoff (ratio >= 0.6) catches a dropped, doubled or
    swapped letter (`stop_timout_s`) without suggesting unrelated keys.
    """
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""
