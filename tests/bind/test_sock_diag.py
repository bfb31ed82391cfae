"""sock_diag: the dump request, the parse of captured kernel replies, and a real dump.

The hex below is what Linux 6.18 (x86_64) answered in a fresh network
namespace holding a listener on 127.0.0.1:8000 (inode 41656), one on [::]:8001
(inode 41657) and an established connection to the first (absent: LISTEN only).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys

import pytest

from supervisor.bind.sock_diag import (
    NLMSG_DONE,
    SOCK_DIAG_BY_FAMILY,
    TCP_LISTEN,
    DiagReply,
    DiagSocket,
    build_dump_request,
    dump_tcp,
    dump_tcp_listeners,
    parse_sock_diag,
)

INET_LISTENER = bytes.fromhex(
    "7c000000140002000100000009500000020a00001f4000007f00000100000000000000000000000000000000"
    "00000000000000000000000000000000031000000000000000000000010000008000000000000000b8a20000"
    "050008000000000008000f00000000000c00150001000000000000000600160052000000"
)
INET6_LISTENER = bytes.fromhex(
    "840000001400020001000000095000000a0a00001f4100000000000000000000000000000000000000000000"
    "00000000000000000000000000000000041000000000000000000000000000008000000000000000b9a20000"
    "050008000000000005000b000000000008000f00000000000c00150001000000000000000600160012000000"
)
DONE = bytes.fromhex("1400000003000200010000000950000000000000")
# The answer to a dump for family 99: NLMSG_ERROR, error -22 (EINVAL), then the request's header.
ERROR_EINVAL = bytes.fromhex(
    "5c000000020000000100000009500000eaffffff48000000140001030100000000000000630600000004000000"
    "0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000"
)

V4 = DiagSocket(socket.AF_INET, TCP_LISTEN, "127.0.0.1", 8000, 0, 41656)
V6 = DiagSocket(socket.AF_INET6, TCP_LISTEN, "::", 8001, 0, 41657)

little_endian = pytest.mark.skipif(
    sys.byteorder != "little", reason="netlink headers are host order: an x86_64 capture"
)


@little_endian
@pytest.mark.parametrize(
    ("data", "want"),
    [
        (INET_LISTENER, DiagReply((V4,), False, 0)),
        (INET6_LISTENER, DiagReply((V6,), False, 0)),
        (DONE, DiagReply((), True, 0)),
        # Several messages in one read (the kernel packs a page's worth).
        (INET_LISTENER + INET6_LISTENER + DONE, DiagReply((V4, V6), True, 0)),
        (ERROR_EINVAL, DiagReply((), True, errno.EINVAL)),
        (b"", DiagReply((), False, 0)),
        # A message cut short (garbled buffer): stop, keep what came whole.
        (INET_LISTENER + INET6_LISTENER[:60], DiagReply((V4,), False, 0)),
        # A header claiming fewer bytes than a header: stop, no endless loop.
        (bytes.fromhex("08000000140002000100000009500000") + DONE, DiagReply((), False, 0)),
    ],
    ids=["inet", "inet6", "done", "packed", "error", "empty", "truncated", "short-length"],
)
def test_parse_sock_diag_reads_captured_replies(data: bytes, want: DiagReply) -> None:
    assert parse_sock_diag(data) == want


@little_endian
def test_the_dump_request_is_the_kernels_struct_layout() -> None:
    # The kernel echoed this request's header in ERROR_EINVAL (len 72, type 20,
    # flags REQUEST|DUMP 0x301, seq 1); body: family 99, IPPROTO_TCP, states 1<<10.
    request = build_dump_request(99, 1 << TCP_LISTEN, 1)
    assert len(request) == 16 + 56  # nlmsghdr + inet_diag_req_v2
    assert request[:24] == ERROR_EINVAL[20:44]
    assert int.from_bytes(request[4:6], sys.byteorder) == SOCK_DIAG_BY_FAMILY
    assert int.from_bytes(DONE[4:6], sys.byteorder) == NLMSG_DONE


def test_a_real_dump_holds_our_listener_and_not_our_connection() -> None:
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
        v6 = stack.enter_context(socket.socket(socket.AF_INET6))
        v6.bind(("::1", 0))
        v6.listen()
        found = dump_tcp_listeners()
        inode = os.fstat(listener.fileno()).st_ino
        assert DiagSocket(socket.AF_INET, TCP_LISTEN, "127.0.0.1", port, os.getuid(), inode) in (
            found
        )
        v6_port = v6.getsockname()[1]
        assert any(s.port == v6_port and s.address == "::1" for s in found)
        client_inode = os.fstat(client.fileno()).st_ino
        assert all(s.inode != client_inode and s.state == TCP_LISTEN for s in found)
        # Asked for established sockets, the kernel names the client's.
        established = dump_tcp(socket.AF_INET, 1 << 1)  # TCP_ESTABLISHED
        assert any(s.inode == client_inode for s in established)
