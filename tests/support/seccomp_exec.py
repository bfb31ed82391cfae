"""Run a command under a seccomp filter that refuses the NUMA memory syscalls with EPERM.

    python tests/support/seccomp_exec.py -- COMMAND [ARG ...]

What a container under the runtime's default seccomp profile gets: Docker's
and containerd's default profiles allow mbind, set_mempolicy, migrate_pages
and move_pages only with CAP_SYS_NICE, which the default capability set
does not hold, so each fails with EPERM. The filter is a real one
(prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER), include/uapi/linux/seccomp.h),
inherited across fork and execve like a container's. x86-64 only (the guest
and CI machines); another architecture exits 2.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
AUDIT_ARCH_X86_64 = 0xC000003E
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
# arch/x86/entry/syscalls/syscall_64.tbl
DENIED = {"mbind": 237, "set_mempolicy": 238, "migrate_pages": 256, "move_pages": 279}


class SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


def program() -> list[tuple[int, int, int, int]]:
    numbers = sorted(DENIED.values())
    prog = [
        (BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    for i, nr in enumerate(numbers):
        # equal: jump to the EPERM return after the remaining tests and the ALLOW
        prog.append((BPF_JEQ_K, len(numbers) - i, 0, nr))
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | 1))  # EPERM
    return prog


def install() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    rows = program()
    filters = (SockFilter * len(rows))(*(SockFilter(*r) for r in rows))
    fprog = SockFprog(len(rows), filters)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or platform.machine() != "x86_64":
        print("usage: seccomp_exec.py -- COMMAND (x86-64 only)", file=sys.stderr)
        return 2
    install()
    os.execvp(args[0], args)
    return 127


if __name__ == "__main__":
    raise SystemExit(main())
