"""`placement-supervisor check`: what `run` probes at start, asked beforehand (does I/O).

Each probe is the one the daemon makes (supervisor.bind.capability, the cgroup
setup, the tree keeper's proc connector, the ready.tcp listener dump, CapEff,
kernel.numa_balancing), undone at once: nothing is created or left changed.
`render_findings` is pure: one line each, "ok NAME: what" or "missing NAME:
why; costs: what the daemon does without it; to get it: how".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.bind.binder import CAP_SYS_NICE, parse_cap_eff
from supervisor.bind.capability import probe_irq, probe_mempolicy, probe_migrate
from supervisor.bind.cgroup import read_cgroup_setup
from supervisor.bind.sock_diag import SockDiagUnavailable, dump_tcp_listeners
from supervisor.config import Config
from supervisor.cpulist import parse_cpulist
from supervisor.hostfs import HostFS
from supervisor.topology.kernel import NUMA_BALANCING, read_numa_balancing
from supervisor.trees.proc_events import nested_pid_namespace, open_proc_events


@dataclass(frozen=True, slots=True)
class Finding:
    """One probe: `ok`, what it found (or why not), and when missing its cost and remedy."""

    name: str
    ok: bool
    detail: str
    costs: str = ""
    remedy: str = ""

    def line(self) -> str:
        if self.ok:
            return f"ok       {self.name}: {self.detail}"
        return f"missing  {self.name}: {self.detail}; costs: {self.costs}; to get it: {self.remedy}"


def render_findings(findings: Sequence[Finding]) -> str:
    """One line per finding, then a summary line (pure)."""
    missing = [f.name for f in findings if not f.ok]
    summary = (
        "all present: run binds everything it plans"
        if not missing
        else f"{len(missing)} missing ({', '.join(missing)}): run starts and stays ready without "
        "them, at the costs above"
    )
    return "\n".join([*(f.line() for f in findings), summary])


def _mems(fs: HostFS) -> frozenset[int]:
    """This process's allowed memory nodes (Mems_allowed_list, proc(5)); node 0 if unreadable."""
    for line in (fs.read_optional("proc/self/status") or "").splitlines():
        if line.startswith("Mems_allowed_list:"):
            return parse_cpulist(line.split(":", 1)[1].strip()) or frozenset({0})
    return frozenset({0})


def check_mempolicy(fs: HostFS) -> Finding:
    mems = sorted(_mems(fs))
    cap = probe_mempolicy(mems)
    if cap.available:
        return Finding("mempolicy", True, f"set_mempolicy and mbind(MPOL_BIND) on nodes {mems}")
    return Finding(
        "mempolicy",
        False,
        f"{cap.reason}",
        "workers' memory is not bound and no page is moved; pages follow the CPUs by first touch "
        '(placement_capability{name="mempolicy"} 0)',
        "give the container CAP_SYS_NICE (docker --cap-add SYS_NICE, a pod's "
        "securityContext.capabilities.add: [SYS_NICE]): moby's default seccomp profile then "
        "allows get_mempolicy, mbind and set_mempolicy (not migrate_pages or move_pages)",
    )


def check_migrate(fs: HostFS) -> Finding:
    mems = sorted(_mems(fs))
    refused = probe_migrate(mems)
    if refused is None:
        return Finding("migrate", True, f"migrate_pages and move_pages on nodes {mems}")
    return Finding(
        "migrate",
        False,
        refused,
        "pages already on the wrong node stay there (a worker's memory follows its CPUs only "
        "for pages it touches after the bind)",
        "a seccomp profile that allows migrate_pages and move_pages (moby's default profile "
        "lists neither, with or without CAP_SYS_NICE): a custom localhost profile, or "
        "seccompProfile: Unconfined",
    )


def check_cgroup(fs: HostFS, config: Config | None) -> Finding:
    if config is not None and config.cgroup == "off":
        return Finding("cgroup", True, 'not wanted (cgroup = "off" in the config)')
    setup, why = read_cgroup_setup(fs)
    if setup is not None:
        return Finding("cgroup", True, f"writable subtree: {why}")
    return Finding(
        "cgroup",
        False,
        f"no writable cgroup subtree: {why}",
        "no per-process cgroups: memory per node is read from numa_maps (slower, under the "
        "worker's mmap lock) and a rank's tree has no cpuset of its own",
        "delegate a cgroup v2 subtree (systemd Delegate=yes, as the shipped unit does; a "
        'container with its own writable cgroup namespace), or set cgroup = "off"',
    )


def check_irq(fs: HostFS, config: Config | None) -> Finding:
    if config is not None and not config.irq.enabled:
        return Finding("irq", True, "not wanted ([irq] enabled = false in the config)")
    cap = probe_irq(fs)
    if cap.available:
        return Finding("irq", True, f"{fs.path('proc/irq')} is writable")
    return Finding(
        "irq",
        False,
        f"{cap.reason}",
        "device IRQs stay where they are, on whichever CPUs irqbalance or the driver chose "
        '(placement_capability{name="irq"} 0)',
        "run as root on the host, or in a privileged container (/proc/irq is one of a "
        "container's read-only paths)",
    )


def check_proc_connector(fs: HostFS) -> Finding:
    costs = (
        "new processes (a worker's forks, a compiler pool) are seen at each check "
        "(check_interval_s), not within milliseconds"
    )
    if nested_pid_namespace(fs.readlink("proc/self/ns/pid")):
        return Finding(
            "proc_connector",
            False,
            "in a child pid namespace (a container): the connector reports host pids",
            costs,
            "run in the host's pid namespace (hostPID: true, docker --pid=host)",
        )
    events, how = open_proc_events()
    if events is not None:
        events.close()
        return Finding("proc_connector", True, how)
    return Finding(
        "proc_connector",
        False,
        how,
        costs,
        "run as root with CAP_NET_ADMIN in the initial user namespace, on a kernel with "
        "CONFIG_PROC_EVENTS",
    )


def check_sock_diag() -> Finding:
    try:
        listeners = dump_tcp_listeners()
    except SockDiagUnavailable as err:
        return Finding(
            "sock_diag",
            False,
            f"{err.strerror}",
            "ready.tcp finds the engine's listener in /proc/<pid>/net/tcp instead (its cost "
            "grows with every socket of the namespace, not with the listeners)",
            "allow socket(AF_NETLINK, SOCK_RAW, NETLINK_SOCK_DIAG) in the seccomp profile or the "
            "unit's SystemCallFilter, on a kernel with CONFIG_INET_DIAG",
        )
    return Finding("sock_diag", True, f"NETLINK_SOCK_DIAG dump ({len(listeners)} TCP listeners)")


def check_sys_nice(fs: HostFS) -> Finding:
    status = fs.read_optional("proc/self/status")
    if status is not None and parse_cap_eff(status) >> CAP_SYS_NICE & 1:
        return Finding("cap_sys_nice", True, "CAP_SYS_NICE in CapEff")
    return Finding(
        "cap_sys_nice",
        False,
        "CAP_SYS_NICE not in CapEff of /proc/self/status",
        "pages of another user's worker, or pages several processes map, are not moved "
        "(migrate_pages(2)); another user's threads are not re-bound",
        "run as root, or grant it (AmbientCapabilities=CAP_SYS_NICE, docker --cap-add "
        "SYS_NICE, a pod's securityContext.capabilities.add: [SYS_NICE])",
    )


def check_numa_balancing(fs: HostFS) -> Finding:
    value = read_numa_balancing(fs)
    name = "numa_balancing"
    if value is None:
        return Finding(name, True, f"{fs.path(NUMA_BALANCING)} absent (no AutoNUMA)")
    if value != 1:
        meaning = "off" if value == 0 else f"{value} (memory tiering only)"
        return Finding(name, True, f"kernel.numa_balancing = {meaning}")
    return Finding(
        name,
        False,
        "kernel.numa_balancing = 1 (AutoNUMA)",
        "hinting faults stall every bound worker thread that touches an unmapped page",
        "sysctl kernel.numa_balancing=0 where every inference process is placed by the "
        "daemon (docs/operations.md, AutoNUMA)",
    )


def run_checks(fs: HostFS, config: Config | None) -> list[Finding]:
    """Every probe `run` makes at start, in its order; `config` says what is wanted."""
    return [
        check_mempolicy(fs),
        check_migrate(fs),
        check_cgroup(fs, config),
        check_irq(fs, config),
        check_proc_connector(fs),
        check_sock_diag(),
        check_sys_nice(fs),
        check_numa_balancing(fs),
    ]
