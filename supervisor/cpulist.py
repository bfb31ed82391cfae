"""Linux CPU/node list and mask formats (pure, no I/O).

The kernel writes sets of CPUs or nodes as lists ("0-3,8-11", see
Documentation/admin-guide/cputopology.rst) or as comma-separated 32-bit hex
words ("00000000,0000000f", as in /proc/<pid>/status Cpus_allowed).
"""

from __future__ import annotations

from collections.abc import Iterable

# Larger than any real machine (the kernel's NR_CPUS max is 8192); guards
# against a garbled "0-4294967295" allocating a huge set.
MAX_ID = 1 << 16


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse "0-3,8,10-11" (whitespace and a trailing newline allowed; "" is empty).

    Raises ValueError naming the bad item.
    """
    result: set[int] = set()
    body = text.strip()
    if not body:
        return frozenset()
    expanded = 0
    for item in body.split(","):
        part = item.strip()
        if not part:
            raise ValueError(f"empty item in list {body!r}")
        # "0-15:2/4" (stride groups) is accepted by the kernel on input only;
        # it never appears in sysfs output, so reject it.
        lo_text, sep, hi_text = part.partition("-")
        try:
            lo = int(lo_text, 10)
            hi = int(hi_text, 10) if sep else lo
        except ValueError:
            raise ValueError(f"bad item {part!r} in list {body!r}") from None
        if lo < 0 or hi < lo or hi >= MAX_ID:
            raise ValueError(f"bad range {part!r} in list {body!r}")
        # The kernel's ranges are disjoint, so together they never exceed
        # MAX_ID ids; "0-65535" repeated a thousand times would spin here.
        expanded += hi - lo + 1
        if expanded > MAX_ID:
            raise ValueError(f"ranges overlap past {MAX_ID} ids in list {body[:80]!r}...")
        result.update(range(lo, hi + 1))
    return frozenset(result)


def format_cpulist(ids: Iterable[int]) -> str:
    """Format ids as the kernel does: sorted ranges, "0-3,8"; empty set -> ""."""
    ordered = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def format_mask(ids: Iterable[int]) -> str:
    """Format ids as a kernel hex mask in 32-bit words ("00000003"; empty -> "0")."""
    value = 0
    for i in ids:
        value |= 1 << i
    digits = f"{value:x}"
    pad = -len(digits) % 8
    digits = "0" * pad + digits
    return ",".join(digits[k : k + 8] for k in range(0, len(digits), 8))
