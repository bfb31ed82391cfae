"""The node agent's look at the node across looks (supervisor.agent.containers.LookCache).

Real processes in real cgroup2 directories under an operator's `--cgroup-root`
(`extra_roots`): each directory below the root is a container. A look reads
every process's /proc/<pid>/cgroup once; the next reads only the processes new
since and the young ones (younger than `settled_s`), whose cgroup a runtime may
still change: runc starts a container's init in its own cgroup and moves it in
just before the exec. A settled process keeps what it was seen in until the
next full look (every `full_every` looks), which bounds how long a process an
operator moves by hand goes unseen.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from supervisor.agent.containers import Container, LookCache, find_containers
from supervisor.hostfs import HostFS
from tests.support.oci import remove_cgroup_tree

pytestmark = pytest.mark.usefixtures("need_root")


def cgroup2_mount() -> Path | None:
    """Where cgroup2 is mounted: a hybrid host's /sys/fs/cgroup/unified, else /sys/fs/cgroup."""
    for mount in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (mount / "cgroup.procs").exists() and not (mount / "tasks").exists():
            return mount
    return None


@pytest.fixture
def root_dir() -> Iterator[tuple[Path, str]]:
    """A fresh cgroup2 directory as an operator's cgroup root, with one
    container cgroup `ctr1` below it; removed afterwards."""
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 hierarchy")
    name = f"ps-look-{uuid.uuid4().hex[:8]}"
    (mount / name / "ctr1").mkdir(parents=True)
    try:
        yield mount / name, f"/{name}"
    finally:
        remove_cgroup_tree(mount / name)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def in_root(found: Sequence[Container], root: str) -> dict[str, int]:
    """container cgroup -> its main pid, for the containers below `root`."""
    return {c.ref.cgroup: c.main.pid for c in found if c.ref.cgroup.startswith(root + "/")}


def test_a_young_process_moved_into_a_container_is_found_at_the_next_look(
    root_dir: tuple[Path, str], sleeper: subprocess.Popen[bytes]
) -> None:
    directory, root = root_dir
    fs = HostFS("/")
    cache = LookCache()
    first = find_containers(fs, extra_roots=(root,), devices=False, cache=cache)
    assert in_root(first, root) == {}
    full_reads = cache.reads
    # As runc's init: started outside, then moved into the container's cgroup.
    (directory / "ctr1" / "cgroup.procs").write_text(str(sleeper.pid))
    second = find_containers(fs, extra_roots=(root,), devices=False, cache=cache)
    assert in_root(second, root) == {f"{root}/ctr1": sleeper.pid}
    # The second look read the young and the new only: the host's settled
    # processes (its kernel threads, its services) came from the first.
    assert 0 < cache.reads - full_reads < full_reads, (full_reads, cache.reads)


def test_a_settled_process_moved_by_hand_is_seen_at_the_next_full_look(
    root_dir: tuple[Path, str], sleeper: subprocess.Popen[bytes]
) -> None:
    directory, root = root_dir
    fs = HostFS("/")
    cache = LookCache(settled_s=0.3, full_every=3)
    time.sleep(0.6)  # the sleeper is settled
    looks = [in_root(find_containers(fs, extra_roots=(root,), devices=False, cache=cache), root)]
    (directory / "ctr1" / "cgroup.procs").write_text(str(sleeper.pid))
    for _ in range(3):
        looks.append(
            in_root(find_containers(fs, extra_roots=(root,), devices=False, cache=cache), root)
        )
    # Looks 1 (full), 2 and 3 (from the cache), 4 (full again: 3 looks later).
    assert looks == [{}, {}, {}, {f"{root}/ctr1": sleeper.pid}], looks


def test_a_look_without_a_cache_reads_every_process_each_time(
    root_dir: tuple[Path, str], sleeper: subprocess.Popen[bytes]
) -> None:
    directory, root = root_dir
    fs = HostFS("/")
    time.sleep(0.1)
    (directory / "ctr1" / "cgroup.procs").write_text(str(sleeper.pid))
    found = find_containers(fs, extra_roots=(root,), devices=False)
    assert in_root(found, root) == {f"{root}/ctr1": sleeper.pid}
