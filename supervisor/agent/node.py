"""The node agent: one attach-mode supervisor per engine container on this node.

Every `interval_s` it finds the containers (supervisor.agent.containers), keeps
those whose main process names an engine kind (or every container under an
operator's `--cgroup-root`, as `kind_default`), splits the CPUs of containers
whose cpusets overlap (supervisor.agent.shares) and runs, per placed container,
one child `python -m supervisor run` with `[engine] attach = { cgroup = ...,
cpus = SHARE, devices = [...] }` (attach mode plans within the container's cgroup
cpuset ∩ its share, on the accelerators the container reaches: the kubelet's Pod
Resources answer, else its device nodes, supervisor.agent.reach; the child itself
runs wherever the agent does). A child is restarted when its
container's cpuset, share or main process changes, or when it exited; it is
stopped (SIGTERM: it detaches, the engine runs on) when its container goes, and
all are stopped on the agent's own SIGTERM. The agent writes no cgroup: the
children run with `cgroup = "off"`.

GET /placement lists the containers with their shares, names and each child's
own /placement; GET /metrics is the children's /metrics with the same seven
labels on every sample (LABEL_NAMES: the Kubernetes names the kubelet's log tree
gives, supervisor.agent.kube_names, else the systemd unit or the cgroup).
GET /healthz says whether the pass loop still finishes passes (the DaemonSet's
probes: /placement answers even when the loop is stuck).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from supervisor.agent.containers import Container, ContainerRef, LookCache, find_containers
from supervisor.agent.grpc_unix import GrpcError
from supervisor.agent.kube_names import KubeNames, read_kube_names
from supervisor.agent.pod_resources import (
    Allotted,
    allotted_pci,
    list_pod_resources,
    nvidia_uuids,
)
from supervisor.agent.reach import Reach, container_reach
from supervisor.agent.shares import compute_shares
from supervisor.cpulist import format_cpulist
from supervisor.hostfs import HostFS
from supervisor.procfs.identity import ProcessId
from supervisor.toml_out import to_toml
from supervisor.topology.accelerators import PCI, VISIBILITY_VARIABLES
from supervisor.topology.cgroupns import NamespaceRoots
from supervisor.topology.device_minors import read_char_devices

ENGINE_KINDS = ("vllm", "sglang", "torchrun", "ray")
STOP_TIMEOUT_S = 30.0
# A child's API answers once its SIGTERM handler is in (it is installed first): a
# child is given this long to answer before it is stopped, so that it detaches.
UP_TIMEOUT_S = 10.0
# A child that exited of itself is started again no sooner than this after its start.
RESTART_AFTER_S = 10.0
# The children's `[drift] check_interval_s` unless the base config sets one: each
# child's pass reads every thread's affinity (some 3 us a thread), so a node of
# 10 containers x 800 threads checked every second costs 3% of a core in passes
# alone. A new thread inherits its creator's binding and a new worker is adopted
# on its fork event, so what waits for the pass is drift someone else causes.
CHILD_CHECK_INTERVAL_S = 10.0
# And their `numa_maps_interval_s`: a worker's numa_maps costs the kernel a walk of
# its page tables (about 1 ms for a small Python worker, more with a model's
# memory), nine a container; pages a worker allocates later are on its node
# already (its threads run there, the kernel's local-first policy), so what a
# read finds late is memory someone else moved.
CHILD_NUMA_MAPS_INTERVAL_S = 60.0
# And their `cpuset_watch_s`: 0, no watch thread of their own. The agent reads each
# container's cpuset at every look and starts its child again within a new one.
CHILD_CPUSET_WATCH_S = 0.0


# /healthz fails once no pass has finished for this many intervals, and never
# sooner than one pass may wait on a child legitimately (its API up, then its
# stop: UP_TIMEOUT_S + STOP_TIMEOUT_S), so that stopping one child is not "stuck".
HEALTH_INTERVALS = 3
HEALTH_FLOOR_S = UP_TIMEOUT_S + STOP_TIMEOUT_S + 5.0


def health(
    *, now: float, started_at: float, last_pass_at: float | None, interval_s: float, containers: int
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of GET /healthz (pure; times from time.monotonic()).

    200 while the last pass finished within HEALTH_INTERVALS x interval_s (at
    least HEALTH_FLOOR_S); before the first, while the agent is younger than
    that (its start-up grace). 503 with the age otherwise."""
    limit_s = max(HEALTH_INTERVALS * interval_s, HEALTH_FLOOR_S)
    age = None if last_pass_at is None else round(now - last_pass_at, 3)
    doc: dict[str, Any] = {"last_pass_age_s": age, "containers": containers, "limit_s": limit_s}
    if last_pass_at is None:
        up_s = now - started_at
        if up_s <= limit_s:
            return 200, doc
        doc["error"] = f"no pass finished in the {up_s:.1f} s since start (limit {limit_s:.1f} s)"
        return 503, doc
    if now - last_pass_at <= limit_s:
        return 200, doc
    doc["error"] = f"last pass finished {now - last_pass_at:.1f} s ago (limit {limit_s:.1f} s)"
    return 503, doc


@dataclass(frozen=True, slots=True)
class AgentOptions:
    listen: tuple[str, int]
    interval_s: float = 2.0
    cgroup_roots: tuple[str, ...] = ()
    kind_default: str | None = None
    pods: tuple[str, ...] = ()  # when given: only these pods' containers
    base_config: Mapping[str, Any] = field(default_factory=dict)
    state_dir: Path = Path("/run/placement-supervisor-agent")
    root: str = "/"
    # The kubelet's log tree (under `root`), where the pods' and containers' names are.
    kube_logs: str = "/var/log"
    # The kubelet's Pod Resources socket (under `root`); "": not asked.
    pod_resources: str = "/var/lib/kubelet/pod-resources/kubelet.sock"


def child_config(
    base: Mapping[str, Any],
    cgroup: str,
    kind: str,
    share: frozenset[int] = frozenset(),
    devices: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """The per-container config: `base` with the attach target, the container's
    `share` of its CPUs (`attach.cpus`) and the accelerators it reaches
    (`attach.devices`; None: unknown, every one of the host's), kind, no cgroups
    and, unless `base` says otherwise, no IRQ placement (pure)."""
    doc: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    doc["cgroup"] = "off"
    # The share goes in the config, not in the child's own affinity: under the
    # kubelet's static CPU manager the container's CPUs are exclusive, outside the
    # agent's (shared-pool) cpuset, so a child could not set its affinity to them;
    # its plan is read from the container's cgroup (docs/attach.md).
    attach: dict[str, Any] = {"cgroup": cgroup}
    if share:
        attach["cpus"] = format_cpulist(share)
    # Devices named in the config by address (accelerator = "pci") have no node the
    # agent could find in a container's /dev: those are all planned, as before.
    if devices is not None and base.get("accelerator") != PCI.name:
        attach["devices"] = list(devices)
    doc.setdefault("engine", {}).update(attach=attach, kind=kind)
    doc["engine"].pop("command", None)
    doc.setdefault("workers", {})["spawned_by"] = "engine"
    drift = doc.setdefault("drift", {})
    drift.setdefault("check_interval_s", CHILD_CHECK_INTERVAL_S)
    drift.setdefault("numa_maps_interval_s", CHILD_NUMA_MAPS_INTERVAL_S)
    drift.setdefault("cpuset_watch_s", CHILD_CPUSET_WATCH_S)
    # IRQs are host-wide: several supervisors would move the same ones. Off unless
    # the base config turns them on (for a node with one engine container).
    doc.setdefault("irq", {}).setdefault("enabled", False)
    return doc


def reach_of_grant(grant: Allotted, uuids: Mapping[str, str], nodes: Reach, cgroup: str) -> Reach:
    """The kubelet's allotment as a reach, where it names devices that all resolve to
    PCI addresses; else `nodes` (the container's device nodes), with a log line when
    the two disagree or an id does not resolve (pure but for the log)."""
    pcis, unresolved = allotted_pci(grant, uuids)
    if unresolved:
        log(
            f"pod resources device ids unresolved cgroup={cgroup} ids={','.join(unresolved)} "
            "action=read device nodes"
        )
        return nodes
    if not pcis:
        return nodes  # none from a device plugin: a privileged pod's own devices, say
    if nodes.devices is not None and set(pcis) != set(nodes.devices):
        log(
            f"pod resources differ from device nodes cgroup={cgroup} "
            f"kubelet={','.join(pcis)} nodes={','.join(nodes.devices) or 'none'} "
            "action=plan the kubelet's"
        )
    return Reach(pcis, source="pod-resources")


# What a child must not inherit from the agent: systemd's notify and socket
# activation, and the agent's own visibility variables (its pod's, not the container's).
CHILD_ENV_DROPS = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    *VISIBILITY_VARIABLES,
)


def child_env(
    environ: Mapping[str, str], name: str, reach: Reach | None, visible: Mapping[str, str]
) -> dict[str, str]:
    """A child's environment (pure): the agent's, less CHILD_ENV_DROPS, with the
    container's visibility variables (`visible`, its main process's) where its
    devices are known. Its CUDA_VISIBLE_DEVICES counts the container's devices,
    which the child's discovery then has alone (`attach.devices`); with them
    unknown the child plans the host's, which the container's indices do not count."""
    env = {k: v for k, v in environ.items() if k not in CHILD_ENV_DROPS}
    if reach is not None and reach.devices is not None:
        env.update(visible)
    env["PLACEMENT_SUPERVISOR_INSTANCE"] = f"agent-{name}"
    return env


# Every sample of the agent's /metrics carries these, in this order, "" when unknown
# (Prometheus stores an empty label as no label): one label set per series, whatever
# the container. In Kubernetes: `namespace` and `pod` (the pod's names), `pod_uid`,
# `container` (its name in the pod spec; id12 when the names are not found) and
# `container_id` (id12). Outside it: `container` and `container_id` are id12,
# `unit` the systemd unit that is the container's cgroup (`docker-<id>.scope`, a
# `--cgroup-root /system.slice` child `vllm.service`), else `cgroup` its path.
LABEL_NAMES = ("namespace", "pod", "pod_uid", "container", "container_id", "unit", "cgroup")


@dataclass(frozen=True, slots=True)
class Names:
    """What a container is called: its Kubernetes names where the kubelet gives them."""

    namespace: str | None = None
    pod: str | None = None
    container: str | None = None


def names_of(ref: ContainerRef, kube: KubeNames | None) -> Names:
    """`ref`'s Kubernetes names in `kube`; none outside a pod or where not found (pure)."""
    if kube is None or ref.pod_uid is None:
        return Names()
    named = kube.container(ref.pod_uid, ref.container_id)
    if named is not None:
        return Names(named.pod.namespace, named.pod.name, named.container)
    pod = kube.pod(ref.pod_uid)  # the pod's directory, when its container's link is not
    return Names() if pod is None else Names(pod.namespace, pod.name)


def container_labels(ref: ContainerRef, names: Names) -> dict[str, str]:
    """The LABEL_NAMES of `ref`'s series, each a string (pure)."""
    id12 = ref.container_id[:12]
    leaf = ref.cgroup.rsplit("/", 1)[-1]
    unit = leaf if ref.pod_uid is None and leaf.endswith((".scope", ".service")) else ""
    return {
        "namespace": names.namespace or "",
        "pod": names.pod or "",
        "pod_uid": ref.pod_uid or "",
        "container": names.container or id12,
        "container_id": id12,
        "unit": unit,
        "cgroup": ref.cgroup if ref.pod_uid is None and not unit else "",
    }


def format_labels(labels: Mapping[str, str]) -> str:
    """`a="x",b="y"` with each value escaped as the text exposition format says
    (backslash, double quote and line feed: a cgroup path may hold any of them) (pure)."""
    return ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def allotted_doc(allotted: Allotted | None) -> dict[str, Any] | None:
    """The /placement view of a container's Pod Resources entry (pure)."""
    if allotted is None:
        return None
    return {
        "devices": [
            {"resource": d.resource, "ids": list(d.ids), "numa_nodes": list(d.numa_nodes)}
            for d in allotted.devices
        ],
        "exclusive_cpus": format_cpulist(frozenset(allotted.cpu_ids)) or None,
    }


def relabel_metrics(text: str, labels: str, seen: set[str]) -> list[str]:
    """`text`'s Prometheus samples with `labels` (`a="x",b="y"`) added to each; a
    HELP or TYPE line already in `seen` is dropped (pure but for `seen`)."""
    out: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            if line not in seen:
                seen.add(line)
                out.append(line)
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            inner = line[brace + 1 :]
            sep = "" if inner.startswith("}") else ","
            out.append(f"{line[: brace + 1]}{labels}{sep}{inner}")
        elif space != -1:
            out.append(f"{line[:space]}{{{labels}}}{line[space:]}")
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Managed:
    """One engine container and the child supervisor that places it."""

    container: Container
    kind: str
    share: frozenset[int] = frozenset()
    reason: str | None = None
    reach: Reach | None = None  # the accelerators it reaches, read for its main process
    proc: asyncio.subprocess.Process | None = None
    port: int = 0
    key: tuple[object, ...] = ()  # what the child was started for
    starts: int = 0
    started_at: float = 0.0  # time.monotonic() of its last start

    @property
    def state(self) -> str:
        if self.reason is not None:
            return "refused"
        if self.proc is None:
            return "starting"
        return "running" if self.proc.returncode is None else "exited"


class NodeAgent:
    def __init__(self, options: AgentOptions) -> None:
        self.options = options
        self.managed: dict[str, Managed] = {}  # by container cgroup
        self.session: ClientSession | None = None
        self.kube: KubeNames | None = None  # the last pass's names; None: no log tree
        self.reported: set[str] = set()  # the log tree's problems already logged
        # Its own cgroup namespace's roots on the host, found once, checked each pass.
        self.ns_roots = NamespaceRoots()
        self.looks = LookCache()  # what the last look found (find_containers)
        self.unread: dict[str, str] = {}  # container cgroup -> what could not be read, logged once
        # Each main process's reach, read once: a container's device nodes are made
        # when it is created (a restart is a new main process).
        self.reaches: dict[ProcessId, Reach] = {}
        self.allotted: dict[ProcessId, Allotted] = {}  # what the kubelet allotted, where it said
        self.kubelet_error: str | None = None  # the last Pod Resources failure, logged once
        self.started_at = time.monotonic()
        self.last_pass_at: float | None = None  # time.monotonic() when a pass last finished

    # -- the loop --------------------------------------------------------------------------

    def engines(self) -> list[tuple[Container, str]]:
        fs = HostFS(self.options.root)
        found = find_containers(
            fs,
            extra_roots=self.options.cgroup_roots,
            ns_roots=self.ns_roots.current(fs),
            devices=False,  # no fds: its device nodes are read once per container (read_reaches)
            cache=self.looks,
        )
        unread = {c.ref.cgroup: c.reason for c in found if c.reason is not None}
        for cgroup, reason in sorted(unread.items()):
            if self.unread.get(cgroup) != reason:
                log(f"container partly unreadable cgroup={cgroup} reason={reason!r} action=list")
        self.unread = unread
        out: list[tuple[Container, str]] = []
        for c in found:
            if self.options.pods and c.ref.pod_uid not in self.options.pods:
                continue
            if c.kind in ENGINE_KINDS:
                out.append((c, c.kind))
            elif c.ref.layout == "extra" and self.options.kind_default is not None:
                out.append((c, self.options.kind_default))
        return out

    def read_names(self) -> KubeNames | None:
        return read_kube_names(HostFS(self.options.root), self.options.kube_logs)

    async def pass_once(self) -> None:
        engines = await asyncio.to_thread(self.engines)
        self.kube = await asyncio.to_thread(self.read_names)
        for problem in () if self.kube is None else self.kube.problems:
            if problem not in self.reported:  # once each: the pass runs every 2 s
                self.reported.add(problem)
                log(f"kubelet log entry skipped {problem} action=no names from it")
        by_cgroup = {c.ref.cgroup: (c, kind) for c, kind in engines}
        for cgroup in sorted(set(self.managed) - set(by_cgroup)):
            m = self.managed.pop(cgroup)
            log(f"container gone cgroup={cgroup} action=stop child")
            await self.stop_child(m)
        readable = {cg: c.cpus for cg, (c, _) in by_cgroup.items() if c.cpus is not None}
        shares = compute_shares(readable)
        mains = {c.main for c, _ in by_cgroup.values()}
        self.reaches = {p: r for p, r in self.reaches.items() if p in mains}
        self.allotted = {p: a for p, a in self.allotted.items() if p in mains}
        new = [c for c, _ in by_cgroup.values() if c.main not in self.reaches]
        if new:  # most passes: none, and no kubelet call, no thread
            allotted = await self.ask_kubelet()
            await asyncio.to_thread(self.read_reaches, new, allotted)
        for cgroup, (c, kind) in sorted(by_cgroup.items()):
            if cgroup not in self.managed:
                self.managed[cgroup] = Managed(c, kind)
                log(f"container found cgroup={cgroup} id={c.ref.container_id[:12]} kind={kind}")
            m = self.managed[cgroup]
            m.container, m.kind = c, kind
            share = shares.get(cgroup)
            if share is None or share.reason is not None:
                reason = "cannot place: its cpuset is unreadable" if share is None else share.reason
                if m.reason != reason:
                    log(f"container refused cgroup={cgroup} reason={reason!r}")
                m.reason, m.share = reason, frozenset()
                await self.stop_child(m)
                continue
            m.reason, m.share = None, share.cpus
            m.reach = self.reaches.get(c.main)
            key = (share.cpus, c.cpus, c.main, kind, m.reach)
            exited = m.proc is not None and m.proc.returncode is not None
            if exited and m.key == key and time.monotonic() - m.started_at < RESTART_AFTER_S:
                continue  # exited of itself, lately: listed `exited` until it is started again
            if m.proc is not None and (m.key != key or exited):
                why = "exited" if exited else "cpuset, share or main process changed"
                log(f"child restart cgroup={cgroup} why={why!r}")
                await self.stop_child(m)
            if m.proc is None:
                await self.start_child(m, key)

    async def ask_kubelet(self) -> list[Allotted] | None:
        """The kubelet's List answer; None when its socket is not there (or not to be
        asked) or the call failed (logged once for each new failure)."""
        if not self.options.pod_resources:
            return None
        path = HostFS(self.options.root).path(self.options.pod_resources.lstrip("/"))
        if not os.path.exists(path):
            return None
        try:
            got = await list_pod_resources(path)
        except GrpcError as err:
            if self.kubelet_error != str(err):
                log(f"pod resources unread error={str(err)!r} action=read device nodes")
            self.kubelet_error = str(err)
            return None
        self.kubelet_error = None
        return got

    def read_reaches(
        self, new: Sequence[Container], allotted: Sequence[Allotted] | None = None
    ) -> None:
        """The reach of each `new` container's main process: the kubelet's allotment
        where it lists the container (by its names) with device ids that all
        resolve; else its device nodes. Once per container (the pass forgets the
        gone), so the host's device numbers are read only when one is new."""
        fs = HostFS(self.options.root)
        numbers = read_char_devices(fs)
        by_name = {(a.namespace, a.pod, a.container): a for a in allotted or ()}
        uuids = nvidia_uuids(fs) if by_name else {}
        for c in new:
            names = names_of(c.ref, self.kube)
            grant = by_name.get((names.namespace or "", names.pod or "", names.container or ""))
            reach = container_reach(fs, c.main.pid, numbers)
            if grant is not None:
                self.allotted[c.main] = grant
                reach = reach_of_grant(grant, uuids, reach, c.ref.cgroup)
            self.reaches[c.main] = reach
            devices = "unknown" if reach.devices is None else ",".join(reach.devices) or "none"
            why = "" if reach.unknown is None else f" why={reach.unknown!r} action=plan all"
            log(
                f"container devices cgroup={c.ref.cgroup} devices={devices} "
                f"source={reach.source}{why}"
            )

    async def start_child(self, m: Managed, key: tuple[object, ...]) -> None:
        c = m.container
        name = c.ref.container_id[:12]
        state = self.options.state_dir
        state.mkdir(parents=True, exist_ok=True)
        config = state / f"{name}.toml"
        base = self.options.base_config
        devices = None if m.reach is None else m.reach.devices
        config.write_text(to_toml(child_config(base, c.ref.cgroup, m.kind, m.share, devices)))
        m.port = free_port()
        env = child_env(os.environ, name, m.reach, c.visible)
        argv = [sys.executable, "-m", "supervisor", "run", "--config", str(config)]
        argv += ["--listen", f"127.0.0.1:{m.port}"]
        with open(state / f"{name}.log", "ab") as logf:
            m.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=logf,
                env=env,
                start_new_session=True,
            )
        m.key = key
        m.starts += 1
        m.started_at = time.monotonic()
        log(
            f"child started cgroup={c.ref.cgroup} pid={m.proc.pid} "
            f"share={format_cpulist(m.share)} port={m.port}"
        )

    async def stop_child(self, m: Managed) -> None:
        proc, m.proc = m.proc, None
        if proc is None:
            return
        if proc.returncode is None:
            await self.wait_up(m, proc)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        log(f"child stopped cgroup={m.container.ref.cgroup} pid={proc.pid} rc={proc.returncode}")

    async def wait_up(self, m: Managed, proc: asyncio.subprocess.Process) -> None:
        """Until `proc`'s API answers (its SIGTERM handler is in), it exits, or UP_TIMEOUT_S."""
        deadline = time.monotonic() + UP_TIMEOUT_S
        while proc.returncode is None and time.monotonic() < deadline:
            if await self.child_get(m, "/placement", proc) is not None:
                return
            await asyncio.sleep(0.2)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop_child(m) for m in self.managed.values()))

    # -- the API ---------------------------------------------------------------------------

    async def child_get(
        self, m: Managed, path: str, proc: asyncio.subprocess.Process | None = None
    ) -> tuple[int, str] | None:
        """(status, body) of GET `path` from `m`'s child (`proc`, else its current one)."""
        proc = proc or m.proc
        if proc is None or proc.returncode is not None or self.session is None:
            return None
        try:
            async with self.session.get(f"http://127.0.0.1:{m.port}{path}") as resp:
                return resp.status, await resp.text()
        except (OSError, TimeoutError):
            return None
        except Exception:  # aiohttp's client errors: the child is not up
            return None

    async def placement_doc(self) -> dict[str, Any]:
        managed = sorted(self.managed.items())
        answers = await asyncio.gather(*(self.child_get(m, "/placement") for _, m in managed))
        docs = []
        for (cgroup, m), got in zip(managed, answers, strict=True):
            placement = None
            if got is not None and got[0] == 200:
                with contextlib.suppress(ValueError):
                    placement = json.loads(got[1])
            c = m.container
            names = names_of(c.ref, self.kube)
            docs.append(
                {
                    "container_id": c.ref.container_id,
                    "pod_uid": c.ref.pod_uid,
                    "namespace": names.namespace,
                    "pod": names.pod,
                    "container": names.container,
                    "cgroup": cgroup,
                    "kind": m.kind,
                    "cpus": None if c.cpus is None else format_cpulist(c.cpus),
                    "share": format_cpulist(m.share) if m.share else None,
                    # The accelerators it reaches (PCI addresses; null: unknown, and why).
                    "devices": None if m.reach is None else m.reach.devices,
                    "devices_unknown": None if m.reach is None else m.reach.unknown,
                    "devices_source": None if m.reach is None else m.reach.source,
                    # The kubelet's Pod Resources answer for it, where it has one.
                    "allotted": allotted_doc(self.allotted.get(c.main)),
                    "visible": dict(c.visible),
                    "state": m.state,
                    "reason": m.reason,
                    "child_pid": None if m.proc is None else m.proc.pid,
                    "placement": placement,
                }
            )
        return {"containers": docs}

    async def metrics_text(self) -> str:
        managed = sorted(self.managed.items())
        answers = await asyncio.gather(*(self.child_get(m, "/metrics") for _, m in managed))
        seen: set[str] = set()
        lines: list[str] = []
        for (_, m), got in zip(managed, answers, strict=True):
            if got is None or got[0] != 200:
                continue
            ref = m.container.ref
            labels = format_labels(container_labels(ref, names_of(ref, self.kube)))
            lines += relabel_metrics(got[1], labels, seen)
        return "\n".join(lines) + "\n"

    async def handle_placement(self, _request: web.Request) -> web.Response:
        return web.json_response(await self.placement_doc())

    async def handle_healthz(self, _request: web.Request) -> web.Response:
        status, doc = health(
            now=time.monotonic(),
            started_at=self.started_at,
            last_pass_at=self.last_pass_at,
            interval_s=self.options.interval_s,
            containers=len(self.managed),
        )
        return web.json_response(doc, status=status)

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=await self.metrics_text(), content_type="text/plain")

    # -- the whole run ---------------------------------------------------------------------

    async def run(self) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        self.session = ClientSession(timeout=ClientTimeout(total=3))
        app = web.Application()
        app.router.add_get("/placement", self.handle_placement)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/healthz", self.handle_healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, port = self.options.listen
        await web.TCPSite(runner, host, port).start()
        log(f"agent listening on {host}:{port} interval_s={self.options.interval_s}")
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await self.pass_once()
                    # Only a pass that ends counts: one that raises every time is no progress.
                    self.last_pass_at = time.monotonic()
                except Exception as exc:  # one bad pass must not end the agent
                    log(f"agent pass failed error={exc!r} action=try again")
                wait = max(0.0, self.options.interval_s - (time.monotonic() - started))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
        finally:
            log("agent stopping action=stop every child (they detach)")
            await self.stop_all()
            await runner.cleanup()
            await self.session.close()
        log("agent stopped")
        return 0


def log(message: str) -> None:
    print(f"placement-agent: {message}", file=sys.stderr, flush=True)


def load_base_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    with open(path, "rb") as f:
        return tomllib.load(f)


def run_agent(options: AgentOptions) -> int:
    return asyncio.run(NodeAgent(options).run())


def parse_host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host or "127.0.0.1", int(port)


def options_from(
    listen: str,
    *,
    interval_s: float,
    cgroup_roots: Sequence[str],
    kind_default: str | None,
    base_config: str | None,
    state_dir: str | None,
    pods: Sequence[str] = (),
    kube_logs: str = "/var/log",
    pod_resources: str = "/var/lib/kubelet/pod-resources/kubelet.sock",
) -> AgentOptions:
    return AgentOptions(
        listen=parse_host_port(listen),
        interval_s=interval_s,
        cgroup_roots=tuple(cgroup_roots),
        kind_default=kind_default,
        pods=tuple(pods),
        base_config=load_base_config(base_config),
        state_dir=Path(state_dir or "/run/placement-supervisor-agent"),
        kube_logs=kube_logs,
        pod_resources=pod_resources,
    )
