"""Listening TCP sockets from the kernel over NETLINK_SOCK_DIAG (does I/O: one netlink socket).

`dump_tcp_listeners` asks the kernel of the caller's network namespace for
its TCP sockets in state LISTEN only (what `ss -lt` does): the cost grows with
the listeners, not with the TIME_WAIT and established sockets beside them.
`dump_tcp_listeners_in` does it from a short-lived thread that joins another
namespace (setns(2)). `build_dump_request` and `parse_sock_diag` are the pure
halves (sock_diag(7)).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import threading
from dataclasses import dataclass

# include/uapi/linux/netlink.h, sock_diag.h, inet_diag.h; sock_diag(7).
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x01
NLM_F_DUMP = 0x100 | 0x200  # NLM_F_ROOT | NLM_F_MATCH
TCP_LISTEN = 10  # include/net/tcp_states.h
CLONE_NEWNET = 0x40000000  # include/uapi/linux/sched.h

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid (native: netlink is host order)
# struct inet_diag_req_v2: family, protocol, ext, pad, states, then inet_diag_sockid.
_REQ_V2 = struct.Struct("=BBBxI")
# struct inet_diag_sockid: sport, dport (__be16), src[4], dst[4] (__be32), if, cookie[2].
_SOCKID = struct.Struct("!HH16s16s")
_SOCKID_SIZE = 48
# struct inet_diag_msg: family, state, timer, retrans, sockid, expires, rqueue, wqueue, uid, inode.
_MSG_HEAD = struct.Struct("=BBBB")
_MSG_TAIL = struct.Struct("=IIIII")
_MSG_SIZE = _MSG_HEAD.size + _SOCKID_SIZE + _MSG_TAIL.size  # 72
_RECV_BYTES = 1 << 16
RECV_TIMEOUT_S = 2.0


class SockDiagUnavailable(OSError):
    """No inet_diag dump for this process: the kernel has none (no
    CONFIG_INET_DIAG, the family's module cannot load), refuses it (a seccomp
    filter such as the unit's `SystemCallErrorNumber=EPERM`, an AppArmor or
    SELinux deny: EPERM, EACCES), or failed it part way. The caller reads
    /proc/<pid>/net/tcp instead. `where` says which step failed."""

    def __init__(self, code: int, where: str) -> None:
        super().__init__(code, f"{where}: {errno.errorcode.get(code, code)} ({os.strerror(code)})")
        self.where = where


# socket(2) refused or unknown: by the kernel (no netlink, no sock_diag) or by a
# filter or LSM of this process (EPERM, EACCES). EMFILE, ENFILE and ENOMEM are a
# shortage, not a refusal: raised, and the probe retries.
_REFUSED = frozenset(
    (errno.EPERM, errno.EACCES, errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EINVAL)
)


@dataclass(frozen=True, slots=True)
class DiagSocket:
    family: int  # socket.AF_INET or AF_INET6
    state: int  # TCP_LISTEN, ...
    address: str  # the local address: "127.0.0.1", "::"
    port: int
    uid: int
    inode: int


@dataclass(frozen=True, slots=True)
class DiagReply:
    """What one recv(2) of a dump held: sockets, whether NLMSG_DONE came, an errno."""

    sockets: tuple[DiagSocket, ...]
    done: bool
    error: int  # 0, or the positive errno of an NLMSG_ERROR


def _align(length: int) -> int:
    return (length + 3) & ~3  # NLMSG_ALIGN


def build_dump_request(family: int, states: int, seq: int) -> bytes:
    """A SOCK_DIAG_BY_FAMILY dump request for TCP sockets in `states` (pure).

    `states` is a bit mask, 1 << TCP_LISTEN for listeners only; the zero
    sockid and no bytecode ask for every such socket of the namespace.
    """
    body = _REQ_V2.pack(family, socket.IPPROTO_TCP, 0, states) + bytes(_SOCKID_SIZE)
    header = _NLMSGHDR.pack(
        _NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0
    )
    return header + body


def parse_sock_diag(data: bytes) -> DiagReply:
    """The netlink messages of one recv(2) of a dump (pure).

    Messages that are too short for what their type says end the parse: the
    kernel never splits a message across reads, so this is a garbled buffer.
    """
    sockets: list[DiagSocket] = []
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or offset + length > len(data):
            break
        body = offset + _NLMSGHDR.size
        if kind == NLMSG_DONE:
            return DiagReply(tuple(sockets), True, 0)
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, body)
            return DiagReply(tuple(sockets), True, -code)
        if kind == SOCK_DIAG_BY_FAMILY and length - _NLMSGHDR.size >= _MSG_SIZE:
            sockets.append(_diag_socket(data, body))
        offset += _align(length)
    return DiagReply(tuple(sockets), False, 0)


def _diag_socket(data: bytes, at: int) -> DiagSocket:
    family, state, _timer, _retrans = _MSG_HEAD.unpack_from(data, at)
    sport, _dport, src, _dst = _SOCKID.unpack_from(data, at + _MSG_HEAD.size)
    _expires, _rqueue, _wqueue, uid, inode = _MSG_TAIL.unpack_from(
        data, at + _MSG_HEAD.size + _SOCKID_SIZE
    )
    # idiag_src is network order; an AF_INET socket uses its first word only.
    raw = src[:4] if family == socket.AF_INET else src
    address = socket.inet_ntop(socket.AF_INET if family == socket.AF_INET else socket.AF_INET6, raw)
    return DiagSocket(family, state, address, sport, uid, inode)


def dump_tcp(family: int, states: int) -> list[DiagSocket]:
    """The TCP sockets of `family` in `states`, in this thread's network namespace.

    Raises SockDiagUnavailable when the socket is refused (`_REFUSED`) or the
    kernel has no handler for the dump, and for any error once the dump was
    asked for (bind, send, a recv error or timeout, an NLMSG_ERROR): a dump cut
    short is no list of listeners. Other OSErrors of socket(2) (EMFILE) as given.
    """
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    except OSError as err:
        if err.errno in _REFUSED:
            raise SockDiagUnavailable(err.errno, "socket(AF_NETLINK, NETLINK_SOCK_DIAG)") from None
        raise
    with sock:
        sock.settimeout(RECV_TIMEOUT_S)  # a kernel that never answers is an error, not a hang
        try:
            sock.bind((0, 0))
            sock.send(build_dump_request(family, states, 1))
            out: list[DiagSocket] = []
            while True:
                reply = parse_sock_diag(sock.recv(_RECV_BYTES))
                out.extend(reply.sockets)
                if reply.error:
                    # ENOENT: no handler for the protocol loads; any other: the dump failed.
                    raise OSError(reply.error, os.strerror(reply.error))
                if reply.done:
                    return out
        except TimeoutError:
            raise SockDiagUnavailable(errno.ETIMEDOUT, "sock_diag dump") from None
        except OSError as err:
            raise SockDiagUnavailable(err.errno or errno.EIO, "sock_diag dump") from None


def dump_tcp_listeners() -> list[DiagSocket]:
    """Every listening TCP socket (IPv4 and IPv6) of this thread's network namespace."""
    states = 1 << TCP_LISTEN
    return dump_tcp(socket.AF_INET, states) + dump_tcp(socket.AF_INET6, states)


_libc: ctypes.CDLL | None = None


def _setns(fd: int, nstype: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, nstype) == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def dump_tcp_listeners_in(netns_path: str) -> list[DiagSocket]:
    """`dump_tcp_listeners` in the network namespace at `netns_path` (a
    process's ns/net link).

    A netlink socket answers for the namespace it was created in, so a new
    thread joins that namespace (setns(2) with CLONE_NEWNET changes the
    calling thread only), opens the socket there and ends: no thread of the
    daemon is left in a foreign namespace. Raises OSError: EPERM without
    CAP_SYS_ADMIN, ENOENT once the process is gone, and `dump_tcp`'s errors.
    """
    found: list[DiagSocket] = []
    failed: list[Exception] = []

    def run() -> None:
        try:
            fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd, CLONE_NEWNET)
            finally:
                os.close(fd)
            found.extend(dump_tcp_listeners())
        except Exception as err:  # handed to the caller's thread
            failed.append(err)

    thread = threading.Thread(target=run, name="sock-diag-netns", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return found
