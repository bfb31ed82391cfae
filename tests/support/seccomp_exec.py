"""Exec a command under a real seccomp filter that refuses socket(AF_NETLINK, *,
NETLINK_SOCK_DIAG) with an errno (what a unit's `SystemCallErrorNumber=EPERM` deny
list or an LSM gives), everything else allowed. The filter is installed with
prctl(2) through ctypes (PR_SET_NO_NEW_PRIVS first, as an unprivileged filter
needs) and is inherited by the command and its children.

    python tests/support/seccomp_exec.py ERRNO -- COMMAND...
"""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import struct
import sys

SOCKET_NR = {"x86_64": 41, "aarch64": 198}  # asm/unistd_64.h, asm-generic/unistd.h
NETLINK_SOCK_DIAG = 4
# BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000


def install(errno_value: int) -> None:
    nr = SOCKET_NR[platform.machine()]
    # seccomp_data: nr at 0, args[0] at 16, args[2] at 32 (low words, little-endian).
    prog = [
        (LD_W_ABS, 0, 0, 0),
        (JEQ_K, 0, 5, nr),
        (LD_W_ABS, 0, 0, 16),
        (JEQ_K, 0, 3, socket.AF_NETLINK),
        (LD_W_ABS, 0, 0, 32),
        (JEQ_K, 0, 1, NETLINK_SOCK_DIAG),
        (RET_K, 0, 0, RET_ERRNO | errno_value),
        (RET_K, 0, 0, RET_ALLOW),
    ]
    insns = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxP", len(prog), ctypes.addressof(insns)))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def main() -> None:
    errno_value, sep, *command = sys.argv[1:]
    assert sep == "--" and command, __doc__
    install(int(errno_value))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
