"""`placement-supervisor run`: the start-up sequence up to the running daemon (does I/O).

In order, each step before anything the next one could leave behind: the
config and the checks `plan --config` makes, the instance lock, the IRQ
checkpoint, discovery and the plan, the cgroups and what the host lets us
bind, then the daemon (supervisor.daemon) on its event loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from supervisor.bind.capability import probe_capabilities
from supervisor.bind.fdlimit import log_fd_limit, raise_fd_limit
from supervisor.config import (
    check_listen,
    load_config_digest,
    read_token_file,
)
from supervisor.daemon.cgroups import (
    cgroups_and_capability,
    instance_suffix,
    remove_cgroups,
)
from supervisor.daemon.hangup import Hangups
from supervisor.daemon.instance_lock import hold_instance_lock
from supervisor.daemon.preflight import check_processes, check_spawns, refuse
from supervisor.daemon.root import Daemon, prepare, run_loop
from supervisor.daemon.state_dir import irq_checkpoint_for
from supervisor.errors import ConfigError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields, setup_logging
from supervisor.run.stop_budget import log_stop_budget
from supervisor.trees.attach import attach_env

log = logging.getLogger("placement_supervisor.daemon")  # the start is the daemon's


def run_command(args: argparse.Namespace) -> int:
    """`placement-supervisor run --config FILE [--listen ...]`; returns the exit code.

    User errors (bad config: 2; unusable topology or infeasible plan: 3) are
    raised as `SupervisorError` for cli.py to print once and exit with.
    """
    env = dict(os.environ)
    level = str(getattr(args, "log_level", None) or "info").upper()
    setup_logging(env, level=logging.getLevelNamesMapping()[level])
    # From here to the exit a HUP is noted or reloads, never a death (a Python
    # handler: unlike SIG_IGN, exec(2) does not pass it on to children).
    hangups = Hangups().install()
    if not getattr(args, "config", None):
        raise ConfigError("run: --config FILE is required")
    config, digest = load_config_digest(args.config)
    listen = getattr(args, "listen", None)
    if listen is not None:
        check_listen("--listen", listen)
    if config.api.token_file is not None:
        read_token_file(config.api.token_file)  # a bad token file stops us before any spawn
    refuse(check_processes(config, env, sys.executable))  # what would crash-loop: exit 2
    # Before any cgroup or process is touched: a second daemon of this config
    # (whatever its --listen) would share them. Held until this returns (the
    # kernel drops it at exit, however this process ends).
    instance = instance_suffix(config, env)
    lock = hold_instance_lock(instance, env, f"{config.path}")
    log_fd_limit(raise_fd_limit())  # before the API sizes its cap; after the lock (one line)
    fs = HostFS("/")
    checkpoint = irq_checkpoint_for(instance, env, fs)  # restores one left behind first
    # Attach mode: the engine's own visibility variables where ours set none.
    env = attach_env(config, env, fs)
    topology, placement = prepare(config, env, fs)
    refuse(check_spawns(config, placement, env, sys.executable))  # argv + env over E2BIG
    cgroups, cgroup_cap = cgroups_and_capability(config, fs, env)
    try:  # a start that fails before run() (whose stop removes them) leaves no cgroup dir
        # Once, before any spawn: what this host (a container's runtime) lets us bind.
        capabilities = probe_capabilities(
            fs,
            topology.allowed.mems,
            cgroup=cgroup_cap,
            irq_wanted=config.irq.enabled,
            irqs_planned=placement.has_irqs,
            irq_checkpoint_problem=checkpoint.probe() if config.irq.enabled else None,
        )
        has_engine = config.engine is not None  # a grace too short for the stop: said once
        log_stop_budget(
            config.stop_timeout_s, config.stop_grace_s, has_engine=has_engine, pid=os.getpid()
        )
        daemon = Daemon(
            config,
            topology,
            placement,
            listen=listen,
            env=env,
            fs=fs,
            cgroups=cgroups,
            check_loop=True,
            subreaper=True,
            irq_checkpoint=checkpoint,
            capabilities=capabilities,
            config_hash=digest,
            hangups=hangups,
            force_exit=True,
        )
    except BaseException:
        if cgroups is not None:
            remove_cgroups(cgroups, [])
        raise
    log.info(
        "starting %s",
        format_fields(
            config=config.path, pid=os.getpid(), processes=len(daemon.keys), action="spawn"
        ),
    )
    try:
        with lock:
            return run_loop(daemon.run())
    finally:
        hangups.close()  # the interpreter's exit would reset a Python handler to SIG_DFL
