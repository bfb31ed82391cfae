"""The netlink proc connector: fork, exec, comm and exit events within milliseconds (does I/O).

A NETLINK_CONNECTOR socket bound to the CN_IDX_PROC group, after a
PROC_CN_MCAST_LISTEN message, receives one `struct proc_event` per fork,
exec, comm change and exit on the host (include/uapi/linux/cn_proc.h,
Documentation/driver-api/connector.rst). It needs CAP_NET_ADMIN (root);
without it `open_proc_events` returns None and the daemon sees new
processes at each check instead. `parse_proc_events` is pure; the socket
is non-blocking and read on the event loop (`ProcEvents.attach`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

NETLINK_CONNECTOR = 11  # include/uapi/linux/netlink.h
CN_IDX_PROC = 1  # include/uapi/linux/connector.h
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1  # enum proc_cn_mcast_op
PROC_CN_MCAST_IGNORE = 2
NLMSG_DONE = 3
# enum what, include/uapi/linux/cn_proc.h
PROC_EVENT_FORK = 0x00000001
PROC_EVENT_EXEC = 0x00000002
PROC_EVENT_COMM = 0x00000200
PROC_EVENT_EXIT = 0x80000000

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT_HEAD = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_PAIR2 = struct.Struct("=iiii")  # fork: parent pid, tgid, child pid, tgid
_PAIR = struct.Struct("=ii")  # exec, comm, exit: pid, tgid
RECV_BYTES = 1 << 16

EventKind = Literal["fork", "exec", "comm", "exit"]


@dataclass(frozen=True, slots=True)
class ProcEvent:
    """One event. `pid` is the thread id, `tgid` its process; for a fork,
    `parent_tgid` is the forking process (a new thread has pid != tgid)."""

    kind: EventKind
    pid: int
    tgid: int
    parent_tgid: int = 0
    timestamp_ns: int = 0

    @property
    def is_process(self) -> bool:
        """A process (or its main thread), not another thread of it."""
        return self.pid == self.tgid


def listen_message(pid: int, op: int = PROC_CN_MCAST_LISTEN) -> bytes:
    """The nlmsghdr + cn_msg + op that subscribes (or unsubscribes) the socket (pure)."""
    body = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, 4, 0) + struct.pack("=I", op)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), NLMSG_DONE, 0, 0, pid) + body


def parse_proc_events(data: bytes) -> list[ProcEvent]:
    """The events of one datagram (possibly several netlink messages); others skipped (pure)."""
    events: list[ProcEvent] = []
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length = _NLMSGHDR.unpack_from(data, offset)[0]
        if length < _NLMSGHDR.size or offset + length > len(data):
            break
        at = offset + _NLMSGHDR.size + _CN_MSG.size
        if at + _EVENT_HEAD.size <= offset + length:
            what, _cpu, ts = _EVENT_HEAD.unpack_from(data, at)
            body = at + _EVENT_HEAD.size
            event = _event(data, body, offset + length, what, ts)
            if event is not None:
                events.append(event)
        offset += (length + 3) & ~3  # NLMSG_ALIGN
    return events


def _event(data: bytes, body: int, end: int, what: int, ts: int) -> ProcEvent | None:
    if what == PROC_EVENT_FORK and body + _PAIR2.size <= end:
        _ppid, ptgid, pid, tgid = _PAIR2.unpack_from(data, body)
        return ProcEvent("fork", pid, tgid, ptgid, ts)
    kind: EventKind | None = {
        PROC_EVENT_EXEC: "exec",
        PROC_EVENT_COMM: "comm",
        PROC_EVENT_EXIT: "exit",
    }.get(what)  # type: ignore[assignment]
    if kind is None or body + _PAIR.size > end:
        return None
    pid, tgid = _PAIR.unpack_from(data, body)
    return ProcEvent(kind, pid, tgid, 0, ts)


class ProcEvents:
    """A subscribed proc connector socket; `attach` delivers batches of events on the loop."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.overruns = 0  # ENOBUFS: events were lost; the next check catches up
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, on_events: Callable[[list[ProcEvent]], None]) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop

        def readable() -> None:
            batch: list[ProcEvent] = []
            for _ in range(256):  # bounded: never starve the loop on a fork storm
                try:
                    data = self.sock.recv(RECV_BYTES)
                except BlockingIOError:
                    break
                except OSError:  # ENOBUFS: the socket overflowed and events were dropped
                    self.overruns += 1
                    continue
                batch.extend(parse_proc_events(data))
            if batch:
                on_events(batch)

        loop.add_reader(self.sock.fileno(), readable)

    def close(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())
            self._loop = None
        self.sock.close()


def open_proc_events() -> tuple[ProcEvents | None, str]:
    """A subscribed, non-blocking proc connector socket, or (None, why not)."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
    except OSError as err:
        return None, f"no netlink connector socket: {err.strerror or err}"
    try:
        sock.bind((0, CN_IDX_PROC))  # port id 0: the kernel assigns one
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.send(listen_message(sock.getsockname()[0] or os.getpid()))
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        return None, f"proc connector refused: {err.strerror or err}"
    return ProcEvents(sock), "netlink proc connector"
