"""The IRQ checkpoint's document and what of it still fits the host (pure, no I/O):
the JSON a daemon writes before its first IRQ write (supervisor.bind.irq_checkpoint
keeps the file) and the writes that put it back.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from supervisor.cpulist import format_cpulist, parse_cpulist

CHECKPOINT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as a whole: garbled, wrong checksum, unknown version."""


# -- pure: the document ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IrqCheckpointData:
    """What a checkpoint holds: whose it is, from which boot, and IRQ -> original CPUs."""

    boot_id: str
    pid: int  # the daemon that wrote it (its guardian restores only its own)
    originals: Mapping[int, frozenset[int]] = field(default_factory=dict)


def _body(data: IrqCheckpointData) -> dict[str, Any]:
    return {
        "version": CHECKPOINT_VERSION,
        "boot_id": data.boot_id,
        "pid": data.pid,
        "irqs": {str(irq): format_cpulist(cpus) for irq, cpus in sorted(data.originals.items())},
    }


def _checksum(body: Mapping[str, Any]) -> str:
    # As the kubelet's checkpoints do (pkg/kubelet/checkpointmanager/checksum):
    # a checksum over the content, written beside it, checked on every read.
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def format_checkpoint(data: IrqCheckpointData) -> str:
    """The file's text: JSON with version, boot id, pid, irqs and checksum (pure)."""
    body = _body(data)
    return json.dumps({**body, "checksum": _checksum(body)}, indent=1, sort_keys=True) + "\n"


def parse_checkpoint(text: str) -> IrqCheckpointData:
    """The checkpoint in `text`; CheckpointError naming what is wrong (pure)."""
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise CheckpointError("not a JSON object")
    checksum = doc.pop("checksum", None)
    if doc.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"version {doc.get('version')!r}, expected {CHECKPOINT_VERSION}")
    if checksum != _checksum(doc):
        raise CheckpointError("checksum mismatch")
    boot_id, pid, irqs = doc.get("boot_id"), doc.get("pid"), doc.get("irqs")
    if set(doc) != {"version", "boot_id", "pid", "irqs"}:
        raise CheckpointError(f"fields {sorted(doc)}")
    if not isinstance(boot_id, str) or not isinstance(pid, int) or not isinstance(irqs, dict):
        raise CheckpointError("boot_id, pid or irqs of the wrong type")
    originals: dict[int, frozenset[int]] = {}
    for key, cpus in irqs.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(cpus, str)):
            raise CheckpointError(f"irq entry {key!r}: {cpus!r}")
        try:
            originals[int(key)] = parse_cpulist(cpus)
        except ValueError as err:
            raise CheckpointError(f"irq {key}: {err}") from None
    return IrqCheckpointData(boot_id, pid, MappingProxyType(originals))


# -- pure: what of it still fits the host -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """The writes that put a checkpoint back on this host, and what did not fit.

    `other_boot`: written before the last reboot, nothing to write. `gone`: IRQs
    this host no longer has. `narrowed`: IRQ -> the CPUs of its original that are
    offline now (the rest is written). `unfit`: none of its CPUs online: left as is.
    """

    writes: Mapping[int, frozenset[int]]
    other_boot: bool = False
    gone: tuple[int, ...] = ()
    narrowed: Mapping[int, frozenset[int]] = field(default_factory=dict)
    unfit: tuple[int, ...] = ()

    @property
    def fits(self) -> bool:
        return not (self.gone or self.narrowed or self.unfit)


def plan_restore(
    data: IrqCheckpointData,
    *,
    boot_id: str,
    irqs: Iterable[int],
    online_cpus: frozenset[int] | None,
) -> RestorePlan:
    """What to write to put `data` back on a host with `irqs` and `online_cpus` (pure).

    `online_cpus` None: unknown, every CPU list is taken as it is.
    """
    if data.boot_id != boot_id:
        return RestorePlan(MappingProxyType({}), other_boot=True)
    present = frozenset(irqs)
    writes: dict[int, frozenset[int]] = {}
    gone: list[int] = []
    narrowed: dict[int, frozenset[int]] = {}
    unfit: list[int] = []
    for irq, cpus in sorted(data.originals.items()):
        if irq not in present:
            gone.append(irq)
            continue
        fit = cpus if online_cpus is None else cpus & online_cpus
        if not fit:
            unfit.append(irq)
            continue
        if fit != cpus:
            narrowed[irq] = cpus - fit
        writes[irq] = fit
    return RestorePlan(
        MappingProxyType(writes),
        gone=tuple(gone),
        narrowed=MappingProxyType(narrowed),
        unfit=tuple(unfit),
    )


def misfit_fields(plan: RestorePlan) -> dict[str, object] | None:
    """The key=values of the one log line for a checkpoint that no longer fits (pure)."""
    if plan.fits:
        return None
    offline = frozenset().union(*plan.narrowed.values()) if plan.narrowed else frozenset()
    return {
        "irqs_gone": format_cpulist(plan.gone) or None,
        "irqs_narrowed": format_cpulist(plan.narrowed) or None,
        "cpus_offline": format_cpulist(offline) or None,
        "irqs_unfit": format_cpulist(plan.unfit) or None,
        "action": "applied as far as it fits",
    }
