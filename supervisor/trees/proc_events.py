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
import ctypes
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable
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
STORM_EVENTS_PER_S = 200  # past this rate the window is the storm's
# The rate is counted over this long: a storm is told within a quarter second
# (until then every read of the quiet window finds events, hundreds a second).
RATE_WINDOW_S = 0.25
# The storm's window: adoption waits at most this much more. A storm's forks
# become members only after 100 ms anyway (keeper STORM_SETTLE_S), and each
# wake-up, cache-cold on a busy host, cost about as much as 20 events.
STORM_WINDOW_S = 0.1
# What the keeper reads of one datagram, in one unpack: nlmsg_len, `what`, and
# the union's first four ints (fork: parent pid, parent tgid, child pid, child
# tgid; exec/comm/exit: pid, tgid, ...). The kernel sends each event alone in
# a datagram of sizeof(struct proc_event) (cn_proc.c send_msg), which holds them.
_HOT = struct.Struct("=I32xI12xiiii")
_KEPT = frozenset((PROC_EVENT_EXEC, PROC_EVENT_COMM, PROC_EVENT_EXIT))

EventKind = Literal["fork", "exec", "comm", "exit"]
# One event of a process as the keeper takes it: (what, pid, parent tgid for a
# fork else 0), `what` a PROC_EVENT_* value. Plain ints, no object per event:
# a fork storm is a thousand events a second, and building a ProcEvent for each
# cost four times its recv.
RawEvent = tuple[int, int, int]
_WHAT = {"fork": PROC_EVENT_FORK, "exec": PROC_EVENT_EXEC, "comm": PROC_EVENT_COMM}


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


def parse_proc_events(data: bytes, *, threads: bool = False) -> list[ProcEvent]:
    """The events of one datagram (possibly several netlink messages); others skipped (pure).

    Events of threads other than a process's main thread are dropped unless
    `threads`: a new thread inherits its creator's binding, so the tree
    keeper only follows processes (and threads are most of the traffic)."""
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
            if event is not None and (threads or event.is_process):
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


def raw_event(event: ProcEvent) -> RawEvent:
    """`event` as the keeper takes it (pure)."""
    return (_WHAT.get(event.kind, PROC_EVENT_EXIT), event.pid, event.parent_tgid)


def read_raw_events(
    recv_into: Callable[[bytearray], int], buf: bytearray, out: list[RawEvent], budget: int
) -> int:
    """Read datagrams with `recv_into` into `buf` until it would block (or
    `budget` datagrams), appending the processes' events to `out`; returns how
    many reads failed with ENOBUFS (the socket overflowed: events were lost).

    One unpack per datagram, threads dropped as `parse_proc_events` drops them;
    a datagram of another shape goes through `parse_proc_events`."""
    hot = _HOT.unpack_from
    overruns = 0
    for _ in range(budget):
        try:
            n = recv_into(buf)
        except BlockingIOError:
            break
        except OSError:  # ENOBUFS
            overruns += 1
            continue
        if n >= _HOT.size:
            size, what, a, b, c, d = hot(buf)
            if 0 <= n - size < 4:  # one message (NLMSG_ALIGN padding at most)
                if what == PROC_EVENT_FORK:
                    if c == d:  # a process, not a thread
                        out.append((PROC_EVENT_FORK, c, b))
                elif a == b and what in _KEPT:
                    out.append((what, a, 0))
                continue
        out.extend(raw_event(e) for e in parse_proc_events(bytes(buf[:n])))
    return overruns


class ProcEvents:
    """A subscribed proc connector socket; `attach` delivers batches of events on the loop."""

    def __init__(self, sock: socket.socket, batch_window_s: float = 0.002) -> None:
        self.sock = sock
        self.quiet_window_s = batch_window_s
        self.batch_window_s = batch_window_s  # longer while a storm lasts
        self.overruns = 0  # ENOBUFS: events were lost; the next check catches up
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None  # the next read, while events come
        self.watched: frozenset[int] | None = None  # None: every process's events
        self._rate_since = time.monotonic()  # the event rate, counted RATE_WINDOW_S at a time
        self._rate_events = 0

    def watch(self, pids: Iterable[int] | None) -> bool:
        """Keep only the forks of `pids` and their exec/comm events (the socket's
        filter is replaced atomically, SO_ATTACH_FILTER); every process's events
        with None or more than WATCH_MAX_PIDS. False when the kernel refused it
        (the filter in place stays)."""
        wanted = None if pids is None else frozenset(pids)
        target = wanted if wanted is not None and len(wanted) <= WATCH_MAX_PIDS else None
        if target == self.watched:
            return True
        try:
            _attach_filter(self.sock, target)
        except OSError:
            return False
        self.watched = target
        return True

    def attach(self, on_events: Callable[[list[RawEvent]], None]) -> None:
        """Deliver events on the loop in batches (`RawEvent`s, in the kernel's order).

        The connector sends one datagram per event for the whole host, and a
        thread pool creating 500 threads/s alone makes 1000 a second: a loop
        wake-up for each cost ~3% of a core. So the first readable datagram
        starts a short window (`batch_window_s`), after which everything
        queued is read at once: a few ms of latency for far fewer wake-ups.
        In a storm, a read that found events reads again one window later,
        without the reader: every wake-up is then a timer, where re-adding the
        reader each time cost a poll handle and two epoll_ctl calls.
        """
        loop = asyncio.get_running_loop()
        self._loop = loop
        fd = self.sock.fileno()
        buf = bytearray(RECV_BYTES)
        recv_into = self.sock.recv_into

        def drain() -> None:
            self._timer = None
            if self._loop is None:  # closed meanwhile
                return
            batch: list[RawEvent] = []
            # Bounded: never starve the loop on a fork storm.
            overruns = read_raw_events(recv_into, buf, batch, 4096)
            self.overruns += overruns
            # A fork storm (hundreds a second): wait longer between reads, so a
            # wake-up reads dozens of events, not three (each wake-up and recv
            # round costs more than the events in it); the short window again
            # once RATE_WINDOW_S passes at a quiet rate.
            self._rate_events += len(batch)
            now = time.monotonic()
            if now - self._rate_since >= RATE_WINDOW_S:
                storm = self._rate_events / (now - self._rate_since) > STORM_EVENTS_PER_S
                self.batch_window_s = STORM_WINDOW_S if storm else self.quiet_window_s
                self._rate_since, self._rate_events = now, 0
            if self.batch_window_s > self.quiet_window_s and (batch or overruns):
                self._timer = loop.call_later(self.batch_window_s, drain)  # a storm: poll
            else:
                loop.add_reader(fd, readable)
            if batch:
                on_events(batch)

        def readable() -> None:
            loop.remove_reader(fd)
            self._timer = loop.call_later(self.batch_window_s, drain)

        loop.add_reader(fd, readable)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())
            self._loop = None
        self.sock.close()


# -- an in-kernel filter ----------------------------------------------------------------
# The connector sends every event of the host, and most are threads (a pool
# creating 500 threads/s alone is 1000 events/s): reading each in Python cost
# ~40 us, 4% of a core. A classic BPF socket filter (socket(7) SO_ATTACH_FILTER,
# Documentation/networking/filter.rst) keeps, in the kernel, only the events the
# keeper acts on: fork, exec and comm of processes (pid == tgid). Exits are
# dropped too: each tree pass finds them, and an adopted worker's exit comes
# through its pidfd. Once the trees are in cgroups the keeper narrows it to a
# watch list of its own processes (`ProcEvents.watch`): the host's other forks
# and execs never wake the daemon.
SO_ATTACH_FILTER = 26
_EVENT_AT = _NLMSGHDR.size + _CN_MSG.size  # `what` of struct proc_event
_BODY_AT = _EVENT_AT + _EVENT_HEAD.size
_LD_ABS, _JEQ_K, _JEQ_X, _TAX, _RET, _JA = 0x20, 0x15, 0x1D, 0x07, 0x06, 0x05
_ACCEPT, _DROP = (_RET, 0, 0, 0xFFFF), (_RET, 0, 0, 0)
# A watch list costs 2 instructions a pid; a cBPF program holds at most 4096
# (BPF_MAXINSNS, include/uapi/linux/bpf_common.h). Past this, all process events.
WATCH_MAX_PIDS = 1500


def _be(value: int) -> int:
    # BPF loads words in network order; the connector writes host order.
    return int.from_bytes(struct.pack("=I", value), "big")


def process_event_filter() -> list[tuple[int, int, int, int]]:
    """The cBPF program (code, jt, jf, k) that keeps process fork/exec/comm (pure)."""
    fork_child, fork_tgid = _BODY_AT + 8, _BODY_AT + 12
    return [
        (_LD_ABS, 0, 0, _EVENT_AT),  # 0: A = what
        (_JEQ_K, 2, 0, _be(PROC_EVENT_FORK)),  # 1: fork -> 4
        (_JEQ_K, 5, 0, _be(PROC_EVENT_EXEC)),  # 2: exec -> 8
        (_JEQ_K, 4, 9, _be(PROC_EVENT_COMM)),  # 3: comm -> 8, else drop
        (_LD_ABS, 0, 0, fork_child),  # 4: A = child pid
        (_TAX, 0, 0, 0),  # 5: X = A
        (_LD_ABS, 0, 0, fork_tgid),  # 6: A = child tgid
        (_JEQ_X, 4, 5, 0),  # 7: a process -> accept, a thread -> drop
        (_LD_ABS, 0, 0, _BODY_AT),  # 8: A = pid
        (_TAX, 0, 0, 0),  # 9: X = A
        (_LD_ABS, 0, 0, _BODY_AT + 4),  # 10: A = tgid
        (_JEQ_X, 0, 1, 0),  # 11: main thread -> accept, else drop
        (_RET, 0, 0, 0xFFFF),  # 12: accept
        (_RET, 0, 0, 0),  # 13: drop
    ]


def watched_event_filter(pids: Iterable[int]) -> list[tuple[int, int, int, int]]:
    """The cBPF program that keeps, of processes only, the forks whose parent is
    in `pids` and the exec/comm events of `pids` (pure).

    The host's other processes fork and exec all the time (tens a second on a
    busy build box); each event read on the loop cost ~80 us, so the daemon
    lists its own processes and the kernel drops the rest. Each pid is a
    compare and an accept (`JEQ pid` falls through to RET accept, else skips
    it), so no conditional jump is longer than one instruction; the long
    jumps to the sections are JA, whose offset is 32 bits."""
    match: list[tuple[int, int, int, int]] = []
    for pid in sorted(set(pids)):
        match += [(_JEQ_K, 0, 1, _be(pid)), _ACCEPT]
    fork = [
        (_LD_ABS, 0, 0, _BODY_AT + 8),  # A = child pid
        (_TAX, 0, 0, 0),
        (_LD_ABS, 0, 0, _BODY_AT + 12),  # A = child tgid
        (_JEQ_X, 1, 0, 0),  # a process: skip the drop
        _DROP,  # a thread
        (_LD_ABS, 0, 0, _BODY_AT + 4),  # A = parent tgid
        *match,
        _DROP,
    ]
    head = [
        (_LD_ABS, 0, 0, _EVENT_AT),  # 0: A = what
        (_JEQ_K, 0, 1, _be(PROC_EVENT_FORK)),  # 1: fork -> 2, else 3
        (_JA, 0, 0, 4),  # 2: -> 7, the fork section
        (_JEQ_K, 1, 0, _be(PROC_EVENT_EXEC)),  # 3: exec -> 5
        (_JEQ_K, 0, 1, _be(PROC_EVENT_COMM)),  # 4: comm -> 5, else 6
        (_JA, 0, 0, len(fork) + 1),  # 5: -> the exec/comm section
        _DROP,  # 6
    ]
    exec_comm = [
        (_LD_ABS, 0, 0, _BODY_AT),  # A = pid
        (_TAX, 0, 0, 0),
        (_LD_ABS, 0, 0, _BODY_AT + 4),  # A = tgid
        (_JEQ_X, 1, 0, 0),  # the main thread: skip the drop
        _DROP,
        *match,
        _DROP,
    ]
    return head + fork + exec_comm


def _attach_filter(sock: socket.socket, pids: Iterable[int] | None = None) -> None:
    program = process_event_filter() if pids is None else watched_event_filter(pids)
    raw = b"".join(struct.pack("=HBBI", *insn) for insn in program)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = struct.pack("@HP", len(program), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


# The initial pid namespace's inode number, fixed (include/linux/proc_ns.h PROC_PID_INIT_INO).
INITIAL_PID_NS = f"pid:[{0xEFFFFFFC}]"


def nested_pid_namespace(ns_link: str | None) -> bool:
    """Whether the /proc/self/ns/pid link (namespaces(7)) names a child pid
    namespace (pure); None (a fixture root without it) is taken as the initial one.

    The connector is of no use there: it numbers every pid as the initial
    namespace does, and ignores a listen request from another pid namespace
    (drivers/connector/cn_proc.c, cn_proc_mcast_ctl), so a container sharing
    the host's network namespace gets the host's events, under numbers that
    are not its own, or none. NSpid in /proc/self/status cannot tell: a
    container's own /proc shows only its own level."""
    return ns_link is not None and ns_link != INITIAL_PID_NS


def open_proc_events(*, filtered: bool = True) -> tuple[ProcEvents | None, str]:
    """A subscribed, non-blocking proc connector socket, or (None, why not).

    `filtered`: only process fork/exec/comm events reach the socket (see above)."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
    except OSError as err:
        return None, f"no netlink connector socket: {err.strerror or err}"
    try:
        sock.bind((0, CN_IDX_PROC))  # port id 0: the kernel assigns one
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        if filtered:
            _attach_filter(sock)
        sock.send(listen_message(sock.getsockname()[0] or os.getpid()))
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        return None, f"proc connector refused: {err.strerror or err}"
    return ProcEvents(sock), "netlink proc connector"
