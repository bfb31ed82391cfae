"""Kernel settings that change what a placement does (reads /proc/sys through HostFS).

`kernel.numa_balancing` (Documentation/admin-guide/sysctl/kernel.rst): 1 turns
on AutoNUMA, which unmaps pages of tasks every few seconds to learn where
they are used and moves pages (and, in mode 1, tasks' preferred nodes)
toward the CPUs that touch them; 2 is memory tiering only. Pages of a task
bound with MPOL_BIND are not moved off its nodes; a task with no policy, or
MPOL_LOCAL, is. Its hinting faults cost every bound worker CPU time.
"""

from __future__ import annotations

from supervisor.hostfs import HostFS

NUMA_BALANCING = "proc/sys/kernel/numa_balancing"


def read_numa_balancing(fs: HostFS) -> int | None:
    """The value of kernel.numa_balancing, or None where the kernel has none
    (built without CONFIG_NUMA_BALANCING) or it is unreadable or garbled."""
    text = fs.read_optional(NUMA_BALANCING)
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None
