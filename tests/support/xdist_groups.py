"""How `pytest -n N` (.ci/test) shares the suite among its worker processes.

A module is one unit of work: its tests run on one worker, in file order, and
share their module fixtures (several modules start one daemon for all their
tests). Modules that share a host-wide resource form one unit, so that they run
one after another on one worker. Units start longest first (the known slow
ones, then by test count), so that no long unit is left to run alone at the
end. Everything else a test touches on the host is its own (a cgroup, a state
dir, a port, a container named by a UUID), or is taken under a host-wide lock
(the IRQs: tests/support/real_irqs.py), as when two runs share the host.

pytest-xdist's own `--dist loadgroup` would do the grouping by marker, but
under pytest 9 its renaming of the test ids has no effect, so the groups are
made here, from the module's path.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadScopeScheduling

# Modules that must not run at the same time as each other.
SHARED = {
    # Real Ray takes fixed ports of its own (its dashboard agent's, metrics export's).
    "tests/trees/test_ray.py": "ray",
    "tests/trees/test_ray_devices.py": "ray",
    "tests/engines/test_ray_config.py": "ray",
    # 5,000 processes started at once starve the host for seconds; Ray's stop
    # (SIGTERM handled 27 s late beside it) must not be timed then: one worker.
    "tests/bind/test_cgroup_procs_whole.py": "ray",
    # runc containers in the kubelet's layout: each test removes the /kubepods
    # parents it made, which another's containers may be using.
    "tests/agent/test_containers.py": "kubepods",
    "tests/agent/test_node_agent.py": "kubepods",
    "tests/agent/test_cgroupns.py": "kubepods",
    "tests/agent/test_node_agent_follows.py": "kubepods",
    "tests/agent/test_containerd.py": "kubepods",
    "tests/agent/test_agent_devices.py": "kubepods",
}

# The longest units, first (seconds with 3 workers on 2 cores, `--durations=0`).
SLOWEST_FIRST = (
    "ray",  # 82 s, and the 5,000-process test's 50 s
    "tests/faults/test_fuzz.py",  # 51 s
    "tests/plan/test_plan_ascend.py",  # 45 s
    "tests/faults/test_special_files.py",  # 35 s
    "tests/examples/test_examples.py",  # 34 s
)


def scope_of(nodeid: str) -> str:
    """The unit of work a test id belongs to (pure)."""
    module = nodeid.split("::", 1)[0]
    return SHARED.get(module, module)


class ByModule(LoadScopeScheduling):
    """LoadScopeScheduling with a module (or a SHARED group) as the scope and the
    SLOWEST_FIRST units at the head of the queue."""

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        # The base hands out the head of its queue (sorted by test count when
        # `--loadscope-reorder`, the default): the slowest known unit goes first.
        for scope in SLOWEST_FIRST:
            if scope in self.workqueue:
                self.workqueue.move_to_end(scope, last=False)
                break
        super()._assign_work_unit(node)


def make_scheduler(config: Any, log: Any) -> ByModule | None:
    if config.getvalue("dist") == "no":
        return None
    return ByModule(config, log)
