"""Which devices this supervisor's engine may use: the visibility variables, CUDA meaning (pure).

docs/contracts.md §1: unset = all; empty or "-1" = none; else comma-separated indices
into the kind's devices (NVIDIA also "GPU-<uuid>", any unique prefix, as
CUDA accepts). A negative entry ends the list, as in CUDA. A kind's
variables (accelerators.AcceleratorKind.visibility) apply in order, each
indexing into what the ones before it left. The list's order is the device
ordinal the engine sees, and so the rank order (docs/contracts.md §3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from supervisor.errors import TopologyError
from supervisor.topology.accelerators import BY_NAME, VISIBILITY_VARIABLES
from supervisor.topology.model import Device

# VISIBILITY_VARIABLES have the CUDA meaning of docs/contracts.md §1. Discovery never
# reads os.environ itself: the CLI and the daemon hand them over.


def visibility_env(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The visibility variables that are set in `environ`, sorted by name (pure)."""
    return tuple(sorted((k, environ[k]) for k in VISIBILITY_VARIABLES if k in environ))


def _resolve_entry(
    entry: str, var: str, value: str, devices: list[Device], uuid_prefix: str | None
) -> Device:
    if entry.isdigit():
        pos = int(entry)
        if pos >= len(devices):
            raise TopologyError(
                f"{var}={value!r}: index {pos} but only {len(devices)} "
                f"{devices[0].kind if devices else ''} devices are visible to it"
            )
        return devices[pos]
    if uuid_prefix is not None and entry.upper().startswith(uuid_prefix):
        matches = [d for d in devices if d.uuid and d.uuid.lower().startswith(entry.lower())]
        if len(matches) == 1:
            return matches[0]
        why = "matches no GPU" if not matches else f"is ambiguous ({len(matches)} GPUs)"
        raise TopologyError(f"{var}={value!r}: {entry!r} {why}")
    raise TopologyError(f"{var}={value!r}: {entry!r} is not a device index")


def parse_visible(
    value: str, var: str, devices: list[Device], uuid_prefix: str | None = None
) -> list[Device]:
    """The devices `value` selects from `devices`, in the order it names them
    (by UUID too, for entries starting with `uuid_prefix`)."""
    body = value.strip()
    if body in {"", "-1"}:
        return []
    selected: list[Device] = []
    for raw in body.split(","):
        entry = raw.strip()
        if entry.startswith("-"):
            break
        device = _resolve_entry(entry, var, value, devices, uuid_prefix)
        if device not in selected:
            selected.append(device)
    return selected


def apply_visibility(devices: tuple[Device, ...], env: Mapping[str, str]) -> tuple[Device, ...]:
    """Devices with `visible` and `ordinal` set (pure).

    A visible device's ordinal is its position in its kind's list, in the
    order the variable names them: `CUDA_VISIBLE_DEVICES=GPU-<6>,GPU-<1>`
    makes GPU 6 ordinal 0, the device CUDA calls cuda:0 and LOCAL_RANK 0
    drives. Without a variable, ordinals follow the index (PCI bus order).
    Kinds without devices ignore their variables (a CUDA_VISIBLE_DEVICES
    left in a CPU-only container is harmless).
    """
    ordinals: dict[tuple[str, int], int] = {}
    for kind in dict.fromkeys(d.kind for d in devices):
        pool = sorted((d for d in devices if d.kind == kind), key=lambda d: d.index)
        record = BY_NAME.get(kind)
        if record is not None:
            for var in record.visibility:
                if var in env:
                    pool = parse_visible(env[var], var, pool, record.uuid_prefix)
        ordinals.update({(d.kind, d.index): pos for pos, d in enumerate(pool)})
    return tuple(
        replace(
            d,
            visible=(d.kind, d.index) in ordinals,
            ordinal=ordinals.get((d.kind, d.index)),
        )
        for d in devices
    )
