"""supervisor.bind.syscalls against the real kernel (memory policy, migrate_pages, prctl)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from supervisor.bind import syscalls
from supervisor.bind.syscalls import _nodemask
from supervisor.errors import Gone, Invalid, KernelError
from tests.support.children import mems_allowed

T = TypeVar("T")


def in_thread(fn: Callable[[], T]) -> T:
    """Run `fn` in a fresh thread: memory policy and thread names are per thread,
    so the test process's own policy is never touched."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # re-raised below, in the test's thread
            box["error"] = err

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def test_nodemask_has_one_spare_bit_in_maxnode() -> None:
    mask, maxnode = _nodemask([0])
    assert list(mask) == [1]
    assert maxnode == 65  # 64 bits + 1: the kernel reads maxnode - 1 bits
    mask, maxnode = _nodemask([1, 64])
    assert list(mask) == [2, 1]
    assert maxnode == 129
    _, maxnode = _nodemask([], 1024)
    assert maxnode == 1025


def test_nodemask_rejects_out_of_range_node() -> None:
    with pytest.raises(OSError, match="out of range"):
        _nodemask([syscalls.MAX_NODES])


def test_syscall_numbers_per_arch() -> None:
    assert syscalls.syscall_number("set_mempolicy", "x86_64") == 238
    assert syscalls.syscall_number("migrate_pages", "x86_64") == 256
    assert syscalls.syscall_number("set_mempolicy", "aarch64") == 237
    assert syscalls.syscall_number("migrate_pages", "aarch64") == 238
    assert syscalls.syscall_number("mbind", "aarch64") == 235


def test_unsupported_arch_is_a_clear_error() -> None:
    with pytest.raises(OSError, match="riscv64") as info:
        syscalls.syscall_number("set_mempolicy", "riscv64")
    assert info.value.errno == errno.ENOSYS
    assert "x86_64" in str(info.value)


def test_bind_then_read_back_then_default() -> None:
    node = min(mems_allowed())

    def body() -> list[tuple[int, frozenset[int]]]:
        seen = [syscalls.get_mempolicy()]
        syscalls.set_mempolicy(syscalls.MPOL_BIND, [node])
        seen.append(syscalls.get_mempolicy())
        syscalls.set_mempolicy(syscalls.MPOL_PREFERRED, [node])
        seen.append(syscalls.get_mempolicy())
        syscalls.set_mempolicy(syscalls.MPOL_DEFAULT)
        seen.append(syscalls.get_mempolicy())
        return seen

    assert in_thread(body) == [
        (syscalls.MPOL_DEFAULT, frozenset()),
        (syscalls.MPOL_BIND, frozenset({node})),
        (syscalls.MPOL_PREFERRED, frozenset({node})),
        (syscalls.MPOL_DEFAULT, frozenset()),
    ]


def test_bind_to_a_node_outside_mems_allowed_is_invalid() -> None:
    outside = max(mems_allowed()) + 1

    def body() -> None:
        syscalls.set_mempolicy(syscalls.MPOL_BIND, [outside])

    with pytest.raises(Invalid) as info:
        in_thread(body)
    assert info.value.errno_name == "EINVAL"
    assert f"nodes {outside}" in info.value.target
    assert in_thread(syscalls.get_mempolicy)[0] == syscalls.MPOL_DEFAULT


def test_migrate_pages_of_self_and_of_a_gone_pid() -> None:
    node = min(mems_allowed())
    assert syscalls.migrate_pages(os.getpid(), [node], [node]) == 0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(Gone) as info:
        syscalls.migrate_pages(child.pid, [node], [node])
    assert info.value.target == f"pid {child.pid}"


def test_move_pages_finds_a_touched_page() -> None:
    buf = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    buf[0] = 1  # fault in the first page only
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    status = syscalls.move_pages(os.getpid(), [addr, addr + 3 * mmap.PAGESIZE])
    assert status[0] in mems_allowed()
    assert status[1] == -errno.ENOENT  # never touched: not present
    del addr
    buf.close()


def test_thread_name_is_set_and_truncated() -> None:
    def body() -> str:
        syscalls.set_thread_name("placement-worker-long")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()

    assert in_thread(body) == "placement-worke"


def test_pdeathsig_round_trip_in_a_child() -> None:
    code = (
        "from supervisor.bind import syscalls as s\n"
        "before = s.get_pdeathsig(); s.set_pdeathsig(9); print(before, s.get_pdeathsig())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["0", "9"]


def test_errors_are_kernel_errors() -> None:
    with pytest.raises(KernelError):
        syscalls.migrate_pages(-5, [0], [0])
