"""What this host lets the supervisor bind, probed once at start (does I/O: syscalls, /proc/irq).

A container's runtime decides: moby's default seccomp profile
(profiles/seccomp/default.json) allows get_mempolicy, mbind, set_mempolicy and
set_mempolicy_home_node only with CAP_SYS_NICE and does not list migrate_pages
or move_pages at all, so under it pages cannot be moved whatever the
capabilities (EPERM); its cgroupfs is read-only and /proc/irq is one of its
readonlyPaths (runtime-spec config-linux.md). Each probe is a real attempt on
the supervisor itself that changes nothing or is undone at once.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Iterable

from supervisor.bind import syscalls
from supervisor.errors import KernelError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
from supervisor.state import Capability, CapabilityName

log = logging.getLogger("placement_supervisor.daemon")

IRQ_PROBE = "proc/irq/default_smp_affinity"


def probe_mempolicy(mems: Iterable[int]) -> Capability:
    """set_mempolicy(MPOL_BIND) on the calling thread, then its old policy back;
    mbind(MPOL_BIND) on a private page of its own, then the page unmapped."""
    nodes = sorted(set(mems))
    try:
        mode, old_nodes = syscalls.get_mempolicy()
    except KernelError as err:
        return Capability("mempolicy", False, reason=f"{err}")
    try:
        syscalls.set_mempolicy(syscalls.MPOL_BIND, nodes)
    except KernelError as err:
        return Capability("mempolicy", False, reason=f"{err}")
    # Back to what it was; MPOL_DEFAULT and MPOL_LOCAL take no nodes.
    restore = () if mode in (syscalls.MPOL_DEFAULT, syscalls.MPOL_LOCAL) else old_nodes
    try:
        syscalls.set_mempolicy(mode, restore)
    except KernelError as err:
        log.warning("mempolicy restore failed %s", format_fields(error=err, action="continue"))
    page = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = ctypes.c_char.from_buffer(page)
        try:
            syscalls.mbind(ctypes.addressof(view), mmap.PAGESIZE, syscalls.MPOL_BIND, nodes)
        except KernelError as err:
            return Capability("mempolicy", False, reason=f"{err}")
        finally:
            del view  # the buffer export must end before the close
    finally:
        page.close()
    return Capability("mempolicy", True)


def probe_migrate(mems: Iterable[int]) -> str | None:
    """Why pages cannot be moved, or None when they can: migrate_pages(2) of this
    process from its nodes to the same nodes and move_pages(2) of no page, both
    no-ops that a seccomp filter refuses before the kernel looks at them."""
    nodes = sorted(set(mems)) or [0]
    for name, call in (
        ("migrate_pages", lambda: syscalls.migrate_pages(0, nodes, nodes)),
        ("move_pages", lambda: syscalls.move_pages(0, ())),
    ):
        try:
            call()
        except KernelError as err:
            hint = ", seccomp?" if err.errno_name == "EPERM" else ""
            return f"pages cannot be moved: {name} refused ({err.errno_name}{hint})"
    return None


def probe_mempolicy_and_migrate(mems: Iterable[int]) -> Capability:
    """`probe_mempolicy`, with the reason pages cannot be moved when the policy
    can be set but migration is refused (moby's profile with CAP_SYS_NICE)."""
    nodes = sorted(set(mems))
    cap = probe_mempolicy(nodes)
    if not cap.available:
        return cap
    refused = probe_migrate(nodes)
    return cap if refused is None else Capability("mempolicy", True, reason=refused)


def probe_irq(fs: HostFS) -> Capability:
    """Write /proc/irq/default_smp_affinity's own value back (changes nothing)."""
    try:
        current = fs.read_text(IRQ_PROBE)
    except OSError as err:
        return Capability("irq", False, reason=f"{fs.path(IRQ_PROBE)}: {err.strerror or err}")
    try:
        fs.write_text(IRQ_PROBE, current.strip())
    except OSError as err:
        return Capability("irq", False, reason=f"{fs.path(IRQ_PROBE)}: {err.strerror or err}")
    return Capability("irq", True)


def probe_capabilities(
    fs: HostFS,
    mems: Iterable[int],
    *,
    cgroup: Capability,
    irq_wanted: bool,
    irqs_planned: bool = True,
    irq_checkpoint_problem: str | None = None,
) -> dict[CapabilityName, Capability]:
    """Every capability; `cgroup` is what the cgroup setup found (service.cgroups).

    Each missing one is said once, here, with its reason and the action. IRQ
    binding is probed whenever [irq] is enabled (a reload may plan IRQs later),
    but missing only while the plan has IRQs to bind (`irqs_planned`; see
    state.capabilities_in_force, which /placement and the metrics show).
    """
    caps: dict[CapabilityName, Capability] = {
        "mempolicy": probe_mempolicy_and_migrate(mems),
        "cgroup": cgroup,
    }
    caps["irq"] = (
        probe_irq(fs) if irq_wanted else Capability("irq", False, wanted=False, reason="irq off")
    )
    if irq_wanted and irq_checkpoint_problem is not None:
        # No IRQ is moved whose original could not be kept on disk first.
        reason = f"irq checkpoint cannot be written: {irq_checkpoint_problem}"
        caps["irq"] = Capability("irq", False, reason=reason)
    for cap in caps.values():
        if cap.name == "irq" and cap.missing and not irqs_planned:
            log.info(
                "capability %s",
                format_fields(
                    name=cap.name, available=False, wanted="no IRQ in the plan", reason=cap.reason
                ),
            )
        elif cap.available and cap.reason is not None:
            # Policies are set, pages stay where they were first touched.
            log.warning(
                "capability partial %s",
                format_fields(name=cap.name, reason=cap.reason, action="bind without moving pages"),
            )
        elif cap.missing:
            log.warning(
                "capability missing %s",
                format_fields(name=cap.name, reason=cap.reason, action="run without, stay ready"),
            )
        else:
            log.info(
                "capability %s",
                format_fields(name=cap.name, available=cap.available, wanted=cap.wanted),
            )
    return caps
