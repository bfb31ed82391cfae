"""Linux syscalls through ctypes: memory policy, page migration, prctl (does I/O: syscalls).

Standard library only and cheap to import (no json, re, signal or dataclasses):
the exec shim imports it before the worker's first instruction. Every OSError
is translated once, here, by `supervisor.errors.translate_oserror`.
"""

from __future__ import annotations

import ctypes
import errno
import os

from supervisor.errors import KernelError, translate_oserror

# Not `from typing import TYPE_CHECKING`: importing typing costs the shim ~6 ms.
# mypy treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

# Memory policy modes, include/uapi/linux/mempolicy.h (see set_mempolicy(2)).
MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_LOCAL = 4
MPOL_PREFERRED_MANY = 5  # Linux 5.15+
# Mode flags that get_mempolicy(2) may OR into the mode it returns.
_MPOL_MODE_FLAGS = (1 << 15) | (1 << 14) | (1 << 13)  # STATIC_NODES, RELATIVE_NODES, NUMA_BALANCING
MODE_NAMES = {
    MPOL_DEFAULT: "default",
    MPOL_PREFERRED: "preferred",
    MPOL_BIND: "bind",
    MPOL_INTERLEAVE: "interleave",
    MPOL_LOCAL: "local",
    MPOL_PREFERRED_MANY: "preferred_many",
}

# migrate_pages(2)/move_pages(2)/mbind(2) flags.
MPOL_MF_MOVE = 1 << 1
MPOL_MF_MOVE_ALL = 1 << 2

# prctl(2) options, include/uapi/linux/prctl.h.
PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2
PR_SET_NAME = 15
TASK_COMM_LEN = 16  # the kernel keeps 15 bytes of a thread name plus NUL

# Syscall numbers. glibc has no wrappers for these (libnuma does), so they go
# through syscall(2). x86-64: arch/x86/entry/syscalls/syscall_64.tbl
# (/usr/include/x86_64-linux-gnu/asm/unistd_64.h); aarch64 uses the generic
# table, include/uapi/asm-generic/unistd.h. Verified against both headers.
SYSCALL_NUMBERS: dict[str, dict[str, int]] = {
    "x86_64": {
        "mbind": 237,
        "set_mempolicy": 238,
        "get_mempolicy": 239,
        "migrate_pages": 256,
        "move_pages": 279,
    },
    "aarch64": {
        "mbind": 235,
        "get_mempolicy": 236,
        "set_mempolicy": 237,
        "migrate_pages": 238,
        "move_pages": 239,
    },
}
SYSCALL_NUMBERS["arm64"] = SYSCALL_NUMBERS["aarch64"]

# The largest node id a nodemask may carry: the kernel's MAX_NUMNODES is at
# most 1 << NODES_SHIFT = 1024 (mm/Kconfig NODES_SHIFT range 1..10).
MAX_NODES = 1024

_WORD_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_libc: ctypes.CDLL | None = None


def machine() -> str:
    """The kernel's architecture name; `platform.machine()` is this, without
    importing `platform` (which costs the shim a few milliseconds)."""
    return os.uname().machine


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
        lib.prctl.restype = ctypes.c_int
        _libc = lib
    return _libc


def syscall_number(name: str, arch: str | None = None) -> int:
    """The number of syscall `name` on `arch` (default: this machine).

    Raises OSError(ENOSYS) naming the architecture when it is not supported.
    """
    arch = arch or machine()
    table = SYSCALL_NUMBERS.get(arch)
    if table is None:
        supported = ", ".join(sorted(SYSCALL_NUMBERS))
        raise OSError(
            errno.ENOSYS,
            f"no syscall number for {name} on architecture {arch!r} (supported: {supported})",
        )
    return table[name]


def _syscall(name: str, *args: object) -> int:
    nr = syscall_number(name)
    ctypes.set_errno(0)
    result = int(_lib().syscall(ctypes.c_long(nr), *args))
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _nodemask(nodes: Iterable[int], nbits: int = 0) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    """A nodemask (array of unsigned long) holding `nodes`, and its `maxnode`.

    `maxnode` is the number of bits plus one: the kernel's get_nodes()
    (mm/mempolicy.c) decrements it before reading "maxnode - 1" bits, an
    off-by-one kept for ABI compatibility. set_mempolicy(2) only says the mask
    holds "up to maxnode bits"; libnuma passes `bitmask->size + 1` for the same
    reason. Passing exactly the bit count would silently drop the top node.
    """
    ids = sorted(set(nodes))
    for node in ids:
        if not 0 <= node < MAX_NODES:
            raise OSError(errno.EINVAL, f"node {node} out of range 0..{MAX_NODES - 1}")
    needed = max(nbits, (ids[-1] + 1) if ids else 1)
    words = -(-needed // _WORD_BITS)
    mask = (ctypes.c_ulong * words)()
    for node in ids:
        mask[node // _WORD_BITS] |= 1 << (node % _WORD_BITS)
    return mask, words * _WORD_BITS + 1


def _mask_nodes(mask: ctypes.Array[ctypes.c_ulong]) -> frozenset[int]:
    return frozenset(
        i * _WORD_BITS + bit
        for i, word in enumerate(mask)
        if word
        for bit in range(_WORD_BITS)
        if word >> bit & 1
    )


def _nodes_text(nodes: Iterable[int]) -> str:
    return ",".join(str(n) for n in sorted(set(nodes))) or "-"


def set_mempolicy(mode: int, nodes: Iterable[int] = ()) -> None:
    """Set the calling thread's memory policy (set_mempolicy(2)).

    The policy is per thread, inherited by threads and processes created
    afterwards and kept across execve(2): set it in the shim, before exec.
    MPOL_DEFAULT takes no nodes; MPOL_PREFERRED with no nodes means "local".
    Raises Invalid (EINVAL: a node outside Mems_allowed, or an empty mask for
    MPOL_BIND) and other KernelError subclasses.
    """
    node_list = list(nodes)
    target = f"set_mempolicy {MODE_NAMES.get(mode, mode)} nodes {_nodes_text(node_list)}"
    try:
        if node_list:
            mask, maxnode = _nodemask(node_list)
            _syscall("set_mempolicy", ctypes.c_int(mode), mask, ctypes.c_ulong(maxnode))
        else:
            _syscall("set_mempolicy", ctypes.c_int(mode), None, ctypes.c_ulong(0))
    except OSError as err:
        raise translate_oserror(target, err) from None


def get_mempolicy() -> tuple[int, frozenset[int]]:
    """The calling thread's memory policy: (mode without flags, nodes) (get_mempolicy(2))."""
    mode = ctypes.c_int(0)
    mask, maxnode = _nodemask((), MAX_NODES)
    try:
        _syscall(
            "get_mempolicy",
            ctypes.byref(mode),
            mask,
            ctypes.c_ulong(maxnode),
            None,
            ctypes.c_ulong(0),
        )
    except OSError as err:
        raise translate_oserror("get_mempolicy", err) from None
    return mode.value & ~_MPOL_MODE_FLAGS, _mask_nodes(mask)


def mbind(address: int, length: int, mode: int, nodes: Iterable[int], flags: int = 0) -> None:
    """Set the memory policy of the range [address, address + length) (mbind(2)).

    Used to probe, on a private anonymous page of the supervisor's own, whether
    the host lets it set a policy at all (a seccomp filter fails mbind with EPERM).
    """
    node_list = list(nodes)
    target = f"mbind {MODE_NAMES.get(mode, mode)} nodes {_nodes_text(node_list)}"
    mask, maxnode = _nodemask(node_list)
    try:
        _syscall(
            "mbind",
            ctypes.c_void_p(address),
            ctypes.c_ulong(length),
            ctypes.c_int(mode),
            mask,
            ctypes.c_ulong(maxnode),
            ctypes.c_uint(flags),
        )
    except OSError as err:
        raise translate_oserror(target, err) from None


def migrate_pages(pid: int, old_nodes: Iterable[int], new_nodes: Iterable[int]) -> int:
    """Move the pages of process `pid` on `old_nodes` to `new_nodes` (migrate_pages(2)).

    Returns the number of pages that could not be moved. Another process's
    pages need CAP_SYS_NICE (or a matching uid); only pages mapped by that
    process alone move without CAP_SYS_NICE. Raises Gone (ESRCH),
    Denied (EPERM), Invalid (EINVAL: a node outside the target's cpuset).
    """
    old, new = list(old_nodes), list(new_nodes)
    target = f"pid {pid}"
    try:
        nbits = max([*old, *new, 0]) + 1
        old_mask, maxnode = _nodemask(old, nbits)
        new_mask, _ = _nodemask(new, nbits)
        return _syscall(
            "migrate_pages", ctypes.c_int(pid), ctypes.c_ulong(maxnode), old_mask, new_mask
        )
    except OSError as err:
        raise translate_oserror(target, err) from None


def move_pages(pid: int, addresses: Iterable[int], node: int | None = None) -> Sequence[int]:
    """move_pages(2) on the pages at `addresses` of process `pid`: with `node`
    None (nodes=NULL) only where each page is; else move each to `node` with
    MPOL_MF_MOVE. The status of each: its node (after the call), or -errno
    (-ENOENT: not present, -EFAULT: not mapped, -EACCES: mapped by several
    processes, left in place, -EBUSY: in use).

    MPOL_MF_MOVE, never MOVE_ALL: a page another process maps too stays where
    it is, whatever our capabilities. The arrays are `array` buffers handed to
    the kernel as they are: no Python object per page (a move of gigabytes is
    millions of pages, on the executor thread that shares the loop's GIL).
    """
    import array  # noqa: PLC0415 - the shim imports this module; only movers pay

    addrs = addresses if isinstance(addresses, array.array) else array.array("Q", addresses)
    count = len(addrs)
    status = array.array("i", bytes(4 * count))
    nodes = None if node is None else array.array("i", [node]) * count
    try:
        _syscall(
            "move_pages",
            ctypes.c_int(pid),
            ctypes.c_ulong(count),
            (ctypes.c_uint64 * count).from_buffer(addrs) if count else None,
            None if nodes is None else (ctypes.c_int * count).from_buffer(nodes),
            (ctypes.c_int * count).from_buffer(status) if count else None,
            ctypes.c_int(0 if node is None else MPOL_MF_MOVE),
        )
    except OSError as err:
        raise translate_oserror(f"pid {pid}", err) from None
    return status


def _prctl(option: int, arg: object, target: str) -> None:
    ctypes.set_errno(0)
    zero = ctypes.c_ulong(0)
    if _lib().prctl(ctypes.c_int(option), arg, zero, zero, zero) != 0:
        err = ctypes.get_errno()
        raise translate_oserror(target, OSError(err, os.strerror(err)))


def set_pdeathsig(signum: int) -> None:
    """Ask for `signum` when the parent *thread* exits (prctl(2) PR_SET_PDEATHSIG).

    Kept across execve(2) (unless set-user-ID), cleared in forked children.
    The parent may already be gone when this runs: callers check getppid().
    """
    _prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signum), "prctl PR_SET_PDEATHSIG")


def get_pdeathsig() -> int:
    """The calling process's parent-death signal (0: none)."""
    value = ctypes.c_int(0)
    _prctl(PR_GET_PDEATHSIG, ctypes.byref(value), "prctl PR_GET_PDEATHSIG")
    return value.value


def set_thread_name(name: str) -> None:
    """Name the calling thread (prctl PR_SET_NAME; 15 bytes kept).

    execve(2) replaces the name with the new program's file name, so this only
    labels the current program (e.g. the shim until it execs).
    """
    raw = name.encode("utf-8", "replace")[: TASK_COMM_LEN - 1]
    _prctl(PR_SET_NAME, ctypes.c_char_p(raw), "prctl PR_SET_NAME")


def reset_signal_default(signum: int) -> None:
    """Put `signum` back to SIG_DFL at the kernel level (libc signal(3)).

    CPython ignores SIGPIPE and SIGXFSZ at start-up; ignored dispositions
    survive execve(2) (signal(7)), so the shim resets them before exec, as
    subprocess's restore_signals does. Done through libc rather than the
    `signal` module, which would cost the shim its enum import.
    """
    handler = ctypes.c_void_p(0)  # SIG_DFL
    lib = _lib()
    lib.signal.restype = ctypes.c_void_p
    ctypes.set_errno(0)
    if lib.signal(ctypes.c_int(signum), handler) == ctypes.c_void_p(-1).value:  # SIG_ERR
        err = ctypes.get_errno()
        raise translate_oserror(f"signal {signum}", OSError(err, os.strerror(err)))


__all__ = [
    "MPOL_BIND",
    "MPOL_DEFAULT",
    "MPOL_INTERLEAVE",
    "MPOL_LOCAL",
    "MPOL_PREFERRED",
    "KernelError",
    "get_mempolicy",
    "get_pdeathsig",
    "migrate_pages",
    "move_pages",
    "reset_signal_default",
    "set_mempolicy",
    "set_pdeathsig",
    "set_thread_name",
    "syscall_number",
]


PR_SET_CHILD_SUBREAPER = 36  # include/uapi/linux/prctl.h


def set_child_subreaper() -> bool:
    """Make this process a child subreaper (prctl(2)): orphaned descendants are
    reparented to it instead of init, so they stay findable and it reaps them."""
    zero = ctypes.c_ulong(0)
    done = int(_lib().prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1), zero, zero, zero))
    return done == 0
