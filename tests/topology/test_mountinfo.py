"""/proc/self/mountinfo: the parser, the cgroup path -> dir mapping, and the readers
that use it (the allowed cpuset, the cgroup setup) on fixture trees of a container."""

from __future__ import annotations

from pathlib import Path

from supervisor.bind.cgroup import read_cgroup_setup
from supervisor.hostfs import HostFS
from supervisor.topology.cgroup import read_cpuset
from supervisor.topology.mountinfo import map_cgroup_path, parse_mountinfo

# What runc gives a container on this host's kind of hybrid layout (v1 cpuset +
# memory, cgroup2 at unified), without a cgroup namespace: each hierarchy's root
# is the container's own cgroup; /proc/self/cgroup still names host paths.
RUNC_V1 = """\
612 598 0:51 / / rw,relatime - overlay overlay rw
620 612 0:54 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro
621 620 0:55 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,mode=755
624 621 0:31 /ps-ctr /sys/fs/cgroup/cpuset ro,nosuid master:15 - cgroup cgroup rw,cpuset
625 621 0:32 /ps-ctr /sys/fs/cgroup/memory ro,nosuid master:16 - cgroup cgroup rw,memory
626 621 0:29 /ps-ctr /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct
627 621 0:38 /ps-ctr /sys/fs/cgroup/unified ro,nosuid - cgroup2 cgroup2 rw
"""
RUNC_V1_CGROUP = "4:cpuset:/ps-ctr\n5:memory:/ps-ctr\n3:cpu,cpuacct:/ps-ctr\n0::/ps-ctr\n"
# A pure cgroup2 container with a cgroup namespace: "/" everywhere.
CGROUPNS_V2 = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
# A pure cgroup2 container without one: its own cgroup is the mount's root.
CONTAINER_V2 = "30 25 0:26 /kubepods/pod1/ctr /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_parse_mountinfo_reads_root_point_type_and_options() -> None:
    mounts = parse_mountinfo(RUNC_V1 + "garbage line\n")
    cpuset = next(m for m in mounts if m.mount_point == "/sys/fs/cgroup/cpuset")
    assert cpuset.root == "/ps-ctr"
    assert cpuset.fstype == "cgroup" and "cpuset" in cpuset.super_options
    assert cpuset.read_only
    assert len(mounts) == 7
    escaped = parse_mountinfo("1 0 0:1 /a\\040b /mnt/x\\040y rw - ext4 /dev/sda rw\n")[0]
    assert (escaped.root, escaped.mount_point) == ("/a b", "/mnt/x y")


def test_the_root_field_maps_a_cgroup_path_under_the_mount_point() -> None:
    mounts = parse_mountinfo(RUNC_V1)
    own = map_cgroup_path(mounts, ("cpuset",), "/ps-ctr")
    assert own is not None and own.rel == "sys/fs/cgroup/cpuset" and own.is_mount_root
    child = map_cgroup_path(mounts, ("cpuset",), "/ps-ctr/rank0")
    assert child is not None and child.rel == "sys/fs/cgroup/cpuset/rank0"
    assert not child.is_mount_root
    co = map_cgroup_path(mounts, ("cpu", "cpuacct"), "/ps-ctr")
    assert co is not None and co.rel == "sys/fs/cgroup/cpu,cpuacct"
    v2 = map_cgroup_path(mounts, (), "/ps-ctr")
    assert v2 is not None and v2.rel == "sys/fs/cgroup/unified"
    # A path outside every mount's root is not visible here.
    assert map_cgroup_path(mounts, ("cpuset",), "/other") is None
    assert map_cgroup_path(mounts, ("cpuset",), "/ps-ctrX") is None
    ns = map_cgroup_path(parse_mountinfo(CGROUPNS_V2), (), "/")
    assert ns is not None and ns.rel == "sys/fs/cgroup"


def _container_v1(root: Path, cpus: str) -> HostFS:
    write(root, "proc/self/mountinfo", RUNC_V1)
    write(root, "proc/self/cgroup", RUNC_V1_CGROUP)
    # The container sees its own cpuset at the mount point, not at .../ps-ctr.
    write(root, "sys/fs/cgroup/cpuset/cpuset.effective_cpus", f"{cpus}\n")
    write(root, "sys/fs/cgroup/cpuset/cpuset.effective_mems", "0\n")
    write(root, "sys/fs/cgroup/cpuset/cpuset.cpus", f"{cpus}\n")
    write(root, "sys/fs/cgroup/memory/memory.numa_stat", "")
    return HostFS(str(root))


def test_a_container_s_cpuset_is_read_at_its_mount_point(tmp_path: Path) -> None:
    fs = _container_v1(tmp_path, "1")
    # A host cpuset dir of the same name must not be read: it is another cgroup.
    write(tmp_path, "sys/fs/cgroup/cpuset/ps-ctr/cpuset.effective_cpus", "0-1\n")
    cs = read_cpuset(fs)
    assert cs is not None and cs.cpus == frozenset({1})
    assert cs.files[0] == "sys/fs/cgroup/cpuset/cpuset.effective_cpus"


def test_a_container_s_writable_v1_cgroup_is_found_through_mountinfo(tmp_path: Path) -> None:
    # Before mountinfo: "cpuset hierarchy for /ps-ctr not found" (the host path
    # /proc/self/cgroup names does not exist inside the container's mount).
    fs = _container_v1(tmp_path, "0-1")
    setup, why = read_cgroup_setup(fs)
    assert setup is not None, why
    assert setup.cpuset_parent == "sys/fs/cgroup/cpuset"
    assert setup.memory_parent == "sys/fs/cgroup/memory"


def test_a_v2_container_s_own_cgroup_is_used_through_a_leaf(tmp_path: Path) -> None:
    # Its cgroupfs read-write (privileged): the container's cgroup is delegated to
    # it. Everything in it moves to a leaf; its own cpuset stays the runtime's.
    write(tmp_path, "proc/self/mountinfo", CONTAINER_V2)
    write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    write(tmp_path, "sys/fs/cgroup/cgroup.type", "domain\n")
    write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu memory\n")
    write(tmp_path, "sys/fs/cgroup/cgroup.subtree_control", "\n")
    write(tmp_path, "sys/fs/cgroup/cpuset.cpus.effective", "2-3\n")
    write(tmp_path, "sys/fs/cgroup/cpuset.mems.effective", "0\n")
    fs = HostFS(str(tmp_path))
    setup, why = read_cgroup_setup(fs)
    assert setup is not None, why
    assert setup.cpuset_parent == "sys/fs/cgroup" and setup.evict_all
    assert "the container's cgroup /kubepods/pod1/ctr" in why
    cs = read_cpuset(fs)
    assert cs is not None and cs.version == 2 and cs.cpus == frozenset({2, 3})
    # Mounted read-only (docker's and the kubelet's default): not delegated.
    write(tmp_path, "proc/self/mountinfo", CONTAINER_V2.replace("rw,nosuid", "ro,nosuid"))
    setup, why = read_cgroup_setup(fs)
    assert setup is None and "mounted read-only" in why
