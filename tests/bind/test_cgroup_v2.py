"""Whether a cgroup v2 dir is delegated: `decide_v2` on facts, and `read_cgroup_setup` on
fixture trees of a container under a cgroup namespace, the host's root, a mount from
outside the namespace, a read-only cgroupfs and controllers not delegated."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.bind.cgroup import read_cgroup_setup
from supervisor.bind.cgroup_v2 import (
    INIT_CGROUP_NS_INODE,
    V2Facts,
    decide_v2,
    parse_ns_inode,
    read_v2_facts,
)
from supervisor.hostfs import HostFS
from supervisor.topology.mountinfo import Mount, parse_mountinfo

# A runc container with a cgroup namespace: cgroup2 mounted afresh inside it,
# its root is the namespace's root, "/" (cgroup_namespaces(7)).
CGROUPNS = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
# The host's cgroup2 mount seen from inside a cgroup namespace made below it.
OUTSIDE = "30 25 0:26 /.. /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
PRIVATE_NS = "cgroup:[4026532201]"


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def container(
    root: Path,
    *,
    mountinfo: str = CGROUPNS,
    controllers: str = "cpuset cpu io memory pids",
    cgroup_type: bool = True,
    ns: str = PRIVATE_NS,
) -> HostFS:
    """A tree in which this process reads "0::/" (a cgroup namespace's root)."""
    write(root, "proc/self/cgroup", "0::/\n")
    write(root, "proc/self/mountinfo", mountinfo)
    (root / "proc/self/ns").mkdir(parents=True, exist_ok=True)
    os.symlink(ns, root / "proc/self/ns/cgroup")
    write(root, "sys/fs/cgroup/cgroup.controllers", f"{controllers}\n")
    write(root, "sys/fs/cgroup/cgroup.subtree_control", "\n")
    write(root, "sys/fs/cgroup/cgroup.procs", "1\n7\n")
    write(root, "sys/fs/cgroup/cpuset.cpus.effective", "2-5\n")
    if cgroup_type:
        write(root, "sys/fs/cgroup/cgroup.type", "domain\n")
    return HostFS(str(root))


def test_the_cgroup_namespace_root_is_the_container_s_cgroup(tmp_path: Path) -> None:
    # Before: taken for the host's root ("0::/", mount root "/"): no eviction,
    # and enabling controllers in a cgroup full of processes failed with EBUSY.
    setup, why = read_cgroup_setup(container(tmp_path))
    assert setup is not None, why
    assert (setup.version, setup.cpuset_parent, setup.memory_parent) == (
        2,
        "sys/fs/cgroup",
        "sys/fs/cgroup",
    )
    assert setup.evict_self and setup.evict_all  # every process of the container to the leaf
    assert "the container's cgroup /" in why and "namespace=private" in why


def test_the_host_s_root_is_never_written_even_in_a_namespace(tmp_path: Path) -> None:
    # No cgroup.type: the root cgroup itself (a namespace made while in the root
    # shows the host's root as "/" too), so the ns inode alone would not tell.
    fs = container(tmp_path, cgroup_type=False)
    setup, why = read_cgroup_setup(fs)
    assert setup is None
    assert "host's root cgroup" in why and "never writes it" in why
    plain = tmp_path / "plain"
    fs = container(plain, cgroup_type=False, ns=f"cgroup:[{INIT_CGROUP_NS_INODE}]")
    setup, why = read_cgroup_setup(fs)
    assert setup is None and "host's root cgroup" in why


def test_a_mount_from_outside_the_namespace_is_not_this_cgroup(tmp_path: Path) -> None:
    # Before: "/" + path under that mount, the host's root dir.
    setup, why = read_cgroup_setup(container(tmp_path, mountinfo=OUTSIDE))
    assert setup is None
    assert "no cgroup2 mount shows /" in why and "namespace=private" in why


def test_a_read_only_cgroupfs_is_not_delegated(tmp_path: Path) -> None:
    # Before: the fixture's files are writable, so the read-only mount went unseen.
    fs = container(tmp_path, mountinfo=CGROUPNS.replace("rw,nosuid", "ro,nosuid"))
    setup, why = read_cgroup_setup(fs)
    assert setup is None
    assert why == "cgroup v2: " + fs.path("sys/fs/cgroup") + " is mounted read-only" + (
        " (not delegated by the runtime)"
    )


def test_cpuset_not_delegated_to_the_namespace_root(tmp_path: Path) -> None:
    facts = read_v2_facts(
        container(tmp_path, controllers="memory pids"),
        "/",
        parse_mountinfo(CGROUPNS),
    )
    assert facts.cgroupns is True and facts.controllers == ("memory", "pids")
    decision, why = decide_v2(facts)
    assert decision is None
    assert why == "cgroup v2: cpuset is not delegated to / (cgroup.controllers: memory pids)"


def _facts(**changes: object) -> V2Facts:
    mount = Mount("/", "/sys/fs/cgroup", "cgroup2", ("rw",), False)
    base = {
        "path": "/system.slice/llm.service",
        "mount": mount,
        "own": "sys/fs/cgroup/system.slice/llm.service",
        "shown": "/sys/fs/cgroup/system.slice/llm.service",
        "is_root_cgroup": False,
        "cgroupns": False,
        "controllers": ("cpuset", "memory"),
        "writable": True,
    }
    base.update(changes)
    return V2Facts(**base)  # type: ignore[arg-type]


def test_decide_a_host_service_s_delegated_cgroup() -> None:
    decision, why = decide_v2(_facts())
    assert decision is not None and decision.owner == "host" and decision.memory
    assert why.startswith("cgroup v2 at /sys/fs/cgroup/system.slice/llm.service (a delegated")
    decision, why = decide_v2(_facts(controllers=("cpuset",), writable=False))
    assert decision is None and why.endswith("is not writable")
    decision, _ = decide_v2(_facts(controllers=("cpuset",)))
    assert decision is not None and not decision.memory


def test_parse_ns_inode() -> None:
    assert parse_ns_inode("cgroup:[4026531835]") == INIT_CGROUP_NS_INODE
    assert parse_ns_inode(PRIVATE_NS) == 4026532201
    assert parse_ns_inode("garbage") is None and parse_ns_inode(None) is None
