"""The `placement-supervisor` command line (contracts §1): the one place that exits (does I/O).

Subcommands: topology, plan, snapshot (here), run and status (imported only
when called). `plan --config` also checks what `run` would fail on
(supervisor.daemon.preflight). `--example NAME` reads a named host
(supervisor.examples) written to a temporary directory, instead of `--root`.
Reads os.environ for the visibility variables only, here, and hands them to
discovery. Exit codes: 0 ok, 2 bad config or arguments, 3 infeasible plan or
unusable topology; a user error is one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

from supervisor import __version__
from supervisor.config import check_listen, load_config
from supervisor.config import discovery_options as config_discovery_options
from supervisor.daemon.preflight import check_config
from supervisor.errors import (
    EXIT_CONFIG,
    EXIT_NOT_READY,
    EXIT_OK,
    EXIT_RELOAD_REFUSED,
    EXIT_UNREACHABLE,
    ConfigError,
    SupervisorError,
)
from supervisor.examples.catalogue import find_example, list_text
from supervisor.hostfs import HostFS
from supervisor.plan.placement import Placement, PlanSettings
from supervisor.plan.planner import plan
from supervisor.plan.render import render_plan_table
from supervisor.topology.discover import NoDevicesError, read_topology
from supervisor.topology.model import DiscoveryOptions, Topology
from supervisor.topology.render import render_topology_text, topology_to_doc
from supervisor.topology.snapshot import take_snapshot

PROG = "placement-supervisor"
LOG_LEVELS = ("debug", "info", "warning", "error")
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130
# `status --help`'s epilog; README "Exit codes" says the same.
STATUS_EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}  the daemon answered and is ready (every process running and bound)
  {EXIT_UNREACHABLE}  no daemon answers at the address, or it answered with an error
  {EXIT_CONFIG}  bad --listen, or --config unreadable or invalid
  {EXIT_NOT_READY}  the daemon answered but is not ready (starting or loading, stopping,
     backoff, failed, stopped, or not bound as planned); the placement is printed anyway
"""
# `check --help`'s epilog; README "Exit codes" says the same.
CHECK_EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}  everything run probes is present
  {EXIT_CONFIG}  --config unreadable or invalid
  {EXIT_NOT_READY}  something is missing: run starts without it, at the cost printed
"""
# `reload --help`'s epilog; README "Exit codes" says the same.
RELOAD_EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}  the daemon applied the config file
  {EXIT_UNREACHABLE}  no daemon answers, it cannot be signalled, or no verdict within --timeout
  {EXIT_CONFIG}  invalid: the file has an error (the old config stays in force)
  {EXIT_RELOAD_REFUSED}  refused: the file is valid but needs a restart
"""


def discovery_options(
    config_path: str | None, environ: Mapping[str, str]
) -> tuple[DiscoveryOptions, PlanSettings]:
    """What discovery and the planner are told: the config's keys, or the defaults."""
    if config_path is None:
        return config_discovery_options(None, environ), PlanSettings()
    config = load_config(config_path)
    return config_discovery_options(config, environ), config.placement


def discover(root: str, options: DiscoveryOptions) -> Topology:
    """Read the host under `root` (a ConfigError if `--root` is not a directory)."""
    if not os.path.isdir(root):
        raise ConfigError(f"--root {root}: not a directory")
    return read_topology(HostFS(root), options)


def make_plan(
    root: str, config_path: str | None, environ: Mapping[str, str]
) -> tuple[Topology, Placement]:
    """Discover and plan, as `plan` does (also used by tests and the bench)."""
    options, settings = discovery_options(config_path, environ)
    topology = discover(root, options)
    return topology, plan(topology, settings)


def dump_json(doc: Any) -> str:
    """JSON with objects indented and lists of numbers on one line (CPU lists stay readable)."""

    def render(value: Any, depth: int) -> str:
        # Scalars first and without json.dumps: a 1,024-node topology holds a
        # million distance values, and dumps() per value was most of its cost.
        kind = type(value)
        if kind is int:
            return str(value)
        if kind is str:
            return encode_basestring_ascii(value)
        pad = "  " * (depth + 1)
        if isinstance(value, dict):
            if not value:
                return "{}"
            items = [
                f"{pad}{encode_basestring_ascii(str(k))}: {render(v, depth + 1)}"
                for k, v in value.items()
            ]
            return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
        if isinstance(value, list):
            if all(not isinstance(v, dict | list) for v in value):
                return json.dumps(value)
            items = [f"{pad}{render(v, depth + 1)}" for v in value]
            return "[\n" + ",\n".join(items) + "\n" + "  " * depth + "]"
        return json.dumps(value)

    return render(doc, 0)


@contextmanager
def host_root(args: argparse.Namespace) -> Iterator[str]:
    """The host tree to read: `--root` (default /), or `--example NAME` built
    into a temporary directory that is removed afterwards."""
    if args.example is None:
        yield args.root if args.root is not None else "/"
        return
    if args.root is not None:
        raise ConfigError(
            f"--example {args.example} and --root {args.root}: give one "
            "(--example builds its own host tree)"
        )
    example = find_example(args.example)  # an unknown name fails before any write
    with tempfile.TemporaryDirectory(prefix="placement-example-") as tmp:
        yield str(example.build(Path(tmp)))


def _listed(args: argparse.Namespace) -> bool:
    """`--example list`: print the examples, one line each."""
    if args.example != "list":
        return False
    print(list_text())
    return True


# -- subcommands ---------------------------------------------------------------


def _cmd_topology(args: argparse.Namespace) -> int:
    if _listed(args):
        return 0
    options, _ = discovery_options(None, os.environ)
    with host_root(args) as root:
        topology = discover(root, options)
    if args.json:
        print(dump_json(topology_to_doc(topology)))
    else:
        print(render_topology_text(topology))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    if _listed(args):
        return 0
    with host_root(args) as root:
        topology, placement = make_plan(root, args.config, os.environ)
    if args.json:
        for warning in topology.warnings:
            print(f"{PROG}: warning: {warning}", file=sys.stderr)
        print(dump_json(placement.to_doc()))
    else:
        for warning in topology.warnings:
            print(f"discovery warning: {warning}")
        print(render_plan_table(placement, topology))
    # What `run` would fail on: only for this host (not a captured --root
    # or an example).
    if args.config is None or os.path.abspath(root) != "/" or args.no_checks:
        return 0
    problems = check_config(
        load_config(args.config), os.environ, sys.executable, placement=placement
    )
    for problem in problems:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
    return EXIT_CONFIG if problems else 0


def _cmd_agent(args: argparse.Namespace) -> int:
    from supervisor.agent.node import options_from, run_agent  # noqa: PLC0415 - this command only

    options = options_from(
        args.listen,
        interval_s=args.interval_s,
        cgroup_roots=args.cgroup_root or (),
        kind_default=args.kind_default,
        base_config=args.base_config,
        state_dir=args.state_dir,
        pods=args.pod or (),
        kube_logs=args.kube_logs,
        pod_resources=args.pod_resources,
    )
    return run_agent(options)


def _cmd_containers(args: argparse.Namespace) -> int:
    from supervisor.agent.containers import find_containers  # noqa: PLC0415 - this command only

    found = find_containers(HostFS(args.root or "/"), extra_roots=tuple(args.cgroup_root or ()))
    if args.json:
        print(dump_json({"containers": [c.to_doc() for c in found]}))
        return 0
    if not found:
        print("no containers found (kubelet, Docker, containerd, CRI-O or Podman cgroups)")
    for c in found:
        doc = c.to_doc()
        pod = f" pod {doc['pod_uid']}" if doc["pod_uid"] else ""
        print(f"{c.ref.container_id[:12]} {c.ref.layout}{pod} pid {c.main.pid} kind {c.kind}")
        print(f"  cgroup {c.ref.cgroup}: cpus {doc['cpus']} mems {doc['mems']}")
        print(f"  devices {', '.join(c.devices) or '-'}; {len(c.pids)} processes: {c.command}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    # What `run` probes at start, probed the same way now (nothing left changed).
    from supervisor.daemon.check import render_findings, run_checks  # noqa: PLC0415

    config = load_config(args.config) if args.config is not None else None
    findings = run_checks(HostFS("/"), config)
    print(render_findings(findings))
    return EXIT_NOT_READY if any(not f.ok for f in findings) else EXIT_OK


def _cmd_snapshot(args: argparse.Namespace) -> int:
    # With --config, the devices it names (`devices = [...]`) are captured too,
    # so that `plan --root OUT --config FILE` reproduces the plan.
    if _listed(args):
        return 0
    options, _ = discovery_options(args.config, os.environ)
    with host_root(args) as root:
        if not os.path.isdir(root):
            raise ConfigError(f"--root {root}: not a directory")
        count = take_snapshot(root, args.out, options)
    source = f"example {args.example}" if args.example else root
    print(f"snapshot: {count} files from {source} copied to {args.out}")
    return 0


# `run` and `status` pull in asyncio, aiohttp and the daemon; `plan` and
# `topology` stay quick to start by importing them only when they run.
def _run_daemon(args: argparse.Namespace) -> int:
    from supervisor.daemon.start import run_command  # noqa: PLC0415

    if args.demo:
        # The demo config ships inside the package (pyproject package-data), so
        # `run --demo` works from any directory after a plain `pip install .`.
        from importlib.resources import as_file, files  # noqa: PLC0415

        with as_file(files("supervisor.demo").joinpath("demo.toml")) as path:
            args.config = str(path)
            return run_command(args)
    return run_command(args)


def _status(args: argparse.Namespace) -> int:
    from supervisor.serve.status import status_command  # noqa: PLC0415

    return status_command(args)


def _reload(args: argparse.Namespace) -> int:
    from supervisor.serve.status import reload_command  # noqa: PLC0415

    return reload_command(args)


def _listen(value: str) -> str:
    try:
        return check_listen("--listen", value)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--listen: ")) from None


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0.1 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(f"{value!r}: seconds from 0.1 to 3600")
    return seconds


def _add_host_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", help="host tree root (default /)")
    p.add_argument(
        "--example",
        metavar="NAME",
        help="read a named example host instead (e.g. dgx-h100; `--example list` lists them)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Discover CPUs, NUMA nodes and accelerators; plan and keep CPU "
        "placement for an inference engine and its worker ranks.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("topology", help="print what discovery finds on this host")
    _add_host_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_topology)

    p = sub.add_parser("plan", help="discover and print the placement plan")
    p.add_argument("--config", help="TOML config (default: built-in defaults)")
    _add_host_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan document")
    p.add_argument(
        "--no-checks",
        action="store_true",
        help="with --config: skip the checks of commands, users, argument sizes, the instance "
        "name, token file and ports "
        "(e.g. on a host where the service already runs and holds its ports)",
    )
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser(
        "check",
        help="probe what run would probe at start: one line each, ok or missing",
        description="Probe, on this host and in this container, what run probes at start "
        "(mempolicy, a writable cgroup subtree, /proc/irq, the proc connector, sock_diag, "
        "CAP_SYS_NICE, kernel.numa_balancing): one line each, ok, or missing with what it "
        "costs and how to get it. Nothing is left changed.",
        epilog=CHECK_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", metavar="FILE", help='what the config wants (cgroup = "off", [irq] enabled)'
    )
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser(
        "containers",
        help="list the containers on this host, as a node agent finds them",
        description="List the containers whose processes run on this host, found from "
        "/proc and the cgroup tree alone (kubelet cgroupfs and systemd layouts, Docker, "
        "containerd, CRI-O, Podman): each one's main process, engine kind, allowed CPUs "
        "and memory nodes, and the accelerators its processes hold open.",
    )
    p.add_argument("--root", help="host tree root (default /)")
    p.add_argument(
        "--cgroup-root",
        action="append",
        metavar="PATH",
        help="a cgroup whose every child is a container (e.g. runc's --cgroups-path parent); "
        "repeatable",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_containers)

    p = sub.add_parser(
        "agent",
        help="place every engine container on this node (one attach-mode supervisor each)",
        description="Node agent: every interval, find the containers on this host (as "
        "`containers` does), give containers whose cpusets overlap disjoint shares of the "
        "CPUs they share, and run one attach-mode supervisor per engine container within "
        "its share (restarted when its container's cpuset, share or main process changes, "
        "stopped when the container goes; they detach, the engines run on). GET /placement "
        "lists the containers, GET /metrics is the supervisors' metrics with namespace, pod, "
        "pod_uid, container, container_id, unit and cgroup labels.",
    )
    p.add_argument("--listen", default="127.0.0.1:9460", help="HOST:PORT for the agent's API")
    p.add_argument(
        "--interval-s", type=float, default=2.0, help="seconds between looks (default 2)"
    )
    p.add_argument(
        "--cgroup-root",
        action="append",
        metavar="PATH",
        help="a cgroup whose every child is a container; repeatable",
    )
    p.add_argument(
        "--kind-default",
        choices=("vllm", "sglang", "torchrun", "ray"),
        help="the kind of a container under --cgroup-root whose command names none",
    )
    p.add_argument(
        "--pod",
        action="append",
        metavar="UID",
        help="place only the containers of this pod (its UID); repeatable",
    )
    p.add_argument(
        "--kube-logs",
        metavar="DIR",
        default="/var/log",
        help="the kubelet's log directory, whose containers/ and pods/ name the pods and "
        "containers (default /var/log; none there: no names, ids only)",
    )
    p.add_argument(
        "--pod-resources",
        metavar="SOCKET",
        default="/var/lib/kubelet/pod-resources/kubelet.sock",
        help="the kubelet's Pod Resources socket, asked which devices each new container "
        "was allotted (default /var/lib/kubelet/pod-resources/kubelet.sock; not there, or "
        "'': the container's device nodes are read instead)",
    )
    p.add_argument(
        "--base-config",
        metavar="FILE",
        help="a config whose tables every container's supervisor gets (e.g. cpu_ranks)",
    )
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="where the per-container configs and logs go "
        "(default /run/placement-supervisor-agent)",
    )
    p.set_defaults(func=_cmd_agent)

    p = sub.add_parser("snapshot", help="copy every file discovery reads into OUT")
    p.add_argument("out", metavar="OUT", help="directory to create")
    _add_host_arguments(p)
    p.add_argument("--config", metavar="FILE", help="also capture the devices this config names")
    p.set_defaults(func=_cmd_snapshot)

    p = sub.add_parser("run", help="run the supervisor daemon")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", help="TOML config")
    which.add_argument(
        "--demo",
        action="store_true",
        help="run the packaged demo (an engine and two workers, no GPU needed; "
        "the config is supervisor/demo/demo.toml)",
    )
    p.add_argument("--listen", type=_listen, help="HOST:PORT or unix:PATH for the API")
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="the least severe log line written (default info; warning keeps only what needs "
        "a look; debug adds reaped orphans and supervision tracebacks)",
    )
    p.set_defaults(func=_run_daemon)

    p = sub.add_parser(
        "status",
        help="show a running daemon's placement",
        description="Query a running daemon and print its placement as a table.",
        epilog=STATUS_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--listen", type=_listen, help="the daemon's HOST:PORT or unix:PATH")
    p.add_argument(
        "--config", metavar="FILE", help="find the daemon where this config's [api] listens"
    )
    p.add_argument("--json", action="store_true", help="print the placement document")
    p.add_argument(
        "--watch",
        nargs="?",
        type=_seconds,
        const=2.0,
        metavar="SECONDS",
        help="print it again every SECONDS (2) until interrupted",
    )
    p.set_defaults(func=_status)

    p = sub.add_parser(
        "reload",
        help="reload a running daemon's config and say what came of it",
        description="SIGHUP the daemon, wait for its verdict and print it: applied, "
        "refused: why (needs a restart), invalid: file: key: why.",
        epilog=RELOAD_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--listen", type=_listen, help="the daemon's HOST:PORT or unix:PATH")
    p.add_argument(
        "--config", metavar="FILE", help="find the daemon where this config's [api] listens"
    )
    p.add_argument("--pid", type=int, help="the daemon's pid (systemd's $MAINPID), checked")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (60)")
    p.set_defaults(func=_reload)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (argparse errors give 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_CONFIG
    try:
        code: int = args.func(args)
    except SupervisorError as err:
        if isinstance(err, NoDevicesError):
            # Discovery cannot know the config's path or the example's name.
            err = err.located(getattr(args, "config", None), getattr(args, "example", None))
        for line in str(err).splitlines() or [""]:  # a refusal may list several problems
            print(f"{PROG}: error: {line}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `plan | head`: the reader left; not an error of ours. Point stdout
        # at /dev/null so the interpreter's final flush does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return code
