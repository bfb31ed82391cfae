"""Exec a command under a real seccomp filter (prctl(2) through ctypes), inherited by
the command and every process it starts, as a container's or a unit's filter is.

    python tests/support/seccomp_exec.py ERRNO -- COMMAND...     # sock_diag refused
    python tests/support/seccomp_exec.py memory -- COMMAND...    # NUMA memory calls refused
    python tests/support/seccomp_exec.py migrate -- COMMAND...   # only page moves refused

- ERRNO: socket(AF_NETLINK, *, NETLINK_SOCK_DIAG) fails with that errno (what a
  unit's `SystemCallErrorNumber=EPERM` deny list or an LSM gives); everything
  else allowed.
- memory: mbind, set_mempolicy, migrate_pages and move_pages fail with EPERM,
  what a container under the runtime's default seccomp profile gets: Docker's
  and containerd's default profiles allow them only with CAP_SYS_NICE, which
  the default capability set does not hold.

- migrate: migrate_pages and move_pages fail with EPERM, the rest allowed: moby's
  default profile with CAP_SYS_NICE (it allows the policy calls with that
  capability and lists neither page mover).

PR_SET_NO_NEW_PRIVS comes first, as an unprivileged filter needs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import socket
import struct
import sys

SOCKET_NR = {"x86_64": 41, "aarch64": 198}  # asm/unistd_64.h, asm-generic/unistd.h
# mbind, set_mempolicy, migrate_pages, move_pages (arch/x86/entry/syscalls/syscall_64.tbl,
# include/uapi/asm-generic/unistd.h)
MEMORY_NRS = {"x86_64": (237, 238, 256, 279), "aarch64": (235, 237, 238, 239)}
NETLINK_SOCK_DIAG = 4
# BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
Insn = tuple[int, int, int, int]


def sock_diag_program(errno_value: int) -> list[Insn]:
    nr = SOCKET_NR[platform.machine()]
    # seccomp_data: nr at 0, args[0] at 16, args[2] at 32 (low words, little-endian).
    return [
        (LD_W_ABS, 0, 0, 0),
        (JEQ_K, 0, 5, nr),
        (LD_W_ABS, 0, 0, 16),
        (JEQ_K, 0, 3, socket.AF_NETLINK),
        (LD_W_ABS, 0, 0, 32),
        (JEQ_K, 0, 1, NETLINK_SOCK_DIAG),
        (RET_K, 0, 0, RET_ERRNO | errno_value),
        (RET_K, 0, 0, RET_ALLOW),
    ]


def memory_program(only_moves: bool = False) -> list[Insn]:
    numbers = MEMORY_NRS[platform.machine()][2 if only_moves else 0 :]
    prog: list[Insn] = [(LD_W_ABS, 0, 0, 0)]
    for i, nr in enumerate(numbers):
        # equal: jump over the remaining tests and the ALLOW to the EPERM return
        prog.append((JEQ_K, len(numbers) - i, 0, nr))
    prog.append((RET_K, 0, 0, RET_ALLOW))
    prog.append((RET_K, 0, 0, RET_ERRNO | errno.EPERM))
    return prog


def install(prog: list[Insn]) -> None:
    insns = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxP", len(prog), ctypes.addressof(insns)))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def main() -> None:
    what, sep, *command = sys.argv[1:]
    assert sep == "--" and command, __doc__
    if what in ("memory", "migrate"):
        install(memory_program(only_moves=what == "migrate"))
    else:
        install(sock_diag_program(int(what)))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
