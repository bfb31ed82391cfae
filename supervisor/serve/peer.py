"""Who is at the other end of the API's unix socket, from the kernel (SO_PEERCRED,
SO_PEERGROUPS; does I/O: getsockopt(2), /proc/<pid>/status as a fallback).

The socket file's mode is a filesystem check that anyone with write access to
the directory, or a `chmod 0666`, undoes; the credentials the kernel recorded
at connect(2) (unix(7)) are the peer's whatever the mode: changing calls over
the socket are allowed to root, the daemon's own user and the members of
`[api] unix_socket_group`.
"""

from __future__ import annotations

import grp
import os
import socket
import struct
from dataclasses import dataclass

from supervisor.errors import ConfigError

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # asm-generic/socket.h, Linux 4.13
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_MAX_GETSOCKOPT_BYTES = 1024  # CPython's getsockopt buflen limit: 256 groups


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    groups: frozenset[int]  # its gid and supplementary groups at connect(2)


def peer_of(sock: socket.socket) -> Peer:
    """The peer of a connected AF_UNIX stream socket; OSError when the kernel says none."""
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    groups = {gid}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _MAX_GETSOCKOPT_BYTES)
        groups.update(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:  # ERANGE: more groups than fit; ENOPROTOOPT: before Linux 4.13
        groups.update(_proc_groups(pid))
    return Peer(pid, uid, frozenset(groups))


def _proc_groups(pid: int) -> set[int]:
    """The Groups: line of /proc/<pid>/status (read now: the peer's, unless it exited)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(word) for word in line.split()[1:]}
    except OSError:
        pass
    return set()


@dataclass(frozen=True, slots=True)
class UnixPolicy:
    """Who may make changing calls over the unix socket."""

    uids: frozenset[int]  # root and the daemon's own user
    gid: int | None = None  # the members of api.unix_socket_group
    group: str | None = None

    @classmethod
    def of(cls, group: str | None) -> UnixPolicy:
        """Root, this process's user and `group`'s members; ConfigError for no such group."""
        gid = None
        if group is not None:
            try:
                gid = (
                    grp.getgrgid(int(group)).gr_gid
                    if group.isdigit()
                    else grp.getgrnam(group).gr_gid
                )
            except (KeyError, ValueError):
                raise ConfigError(
                    f"api.unix_socket_group: no group {group!r} on this host"
                ) from None
        return cls(frozenset((0, os.geteuid())), gid, group)

    def refusal(self, peer: Peer) -> str | None:
        """None when `peer` may make changing calls, else why not (one line)."""
        if peer.uid in self.uids or (self.gid is not None and self.gid in peer.groups):
            return None
        who = "root or the supervisor's user" + (f" or group {self.group}" if self.group else "")
        return (
            f"changing calls over the unix socket need {who}; "
            f"the peer (pid {peer.pid}, uid {peer.uid}) is none of them"
        )
