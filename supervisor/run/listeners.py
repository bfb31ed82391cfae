"""Who holds a listening TCP port: the engine's tree, or someone else (reads /proc, netlink).

The readiness probe `ready.tcp` must not take another program's listener for
the engine's: an engine that crash-loops on EADDRINUSE would look ready at
once. `read_listeners` asks the kernel for the LISTEN sockets of the engine's
network namespace only (NETLINK_SOCK_DIAG, `supervisor.bind.sock_diag`), or
streams `/proc/<pid>/net/tcp{,6}` keeping the LISTEN rows (a fixture tree, a
namespace it cannot join); `tree_pids` walks the engine's descendants;
`socket_inodes` reads their `/proc/<pid>/fd` links (`socket:[INODE]`, proc(5)).
Reading another user's fd table needs CAP_SYS_PTRACE (kept in the unit's
bounding set).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
from dataclasses import dataclass

from supervisor.bind.sock_diag import (
    SockDiagUnavailable,
    dump_tcp_listeners,
    dump_tcp_listeners_in,
)
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields
from supervisor.procfs.stat import children_map, scan_procs

log = logging.getLogger("placement_supervisor.probe")

TCP_LISTEN = "0A"  # include/net/tcp_states.h: TCP_LISTEN = 10


@dataclass(frozen=True, slots=True)
class Listener:
    address: str  # "127.0.0.1", "::"
    port: int
    inode: int


def _address(hex_text: str) -> str:
    """A /proc/net/tcp address: 32-bit words printed in host byte order ("%08X")."""
    raw = b"".join(
        int(hex_text[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_text), 8)
    )
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw)


def parse_listener_line(line: str) -> Listener | None:
    """The socket of one /proc/net/tcp{,6} row when it is in state LISTEN (pure)."""
    fields = line.split()
    if len(fields) < 10 or fields[3] != TCP_LISTEN:
        return None
    addr, _, port = fields[1].partition(":")
    try:
        return Listener(_address(addr), int(port, 16), int(fields[9]))
    except ValueError:
        return None


def parse_listeners(text: str) -> list[Listener]:
    """The LISTEN sockets of a /proc/net/tcp or tcp6 table (pure)."""
    rows = (parse_listener_line(line) for line in text.splitlines()[1:])
    return [row for row in rows if row is not None]


def serves(listener: Listener, host: str, port: int) -> bool:
    """Would a connection to host:port reach this listener? (pure)

    A wildcard listener (0.0.0.0, ::) serves every address; a host name
    ("localhost") is not resolved here, so only the port is compared.
    """
    if listener.port != port:
        return False
    try:
        target = ipaddress.ip_address(host)
    except ValueError:
        return True
    bound = ipaddress.ip_address(listener.address)
    if bound.is_unspecified:
        return True
    if isinstance(bound, ipaddress.IPv6Address) and bound.ipv4_mapped is not None:
        bound = bound.ipv4_mapped
    return bound == target


def same_netns(fs: HostFS, pid: int) -> bool:
    """Is `pid` in this thread's network namespace? (False on a fixture tree, or
    when the link cannot be read: another user's process without CAP_SYS_PTRACE.)"""
    if not fs.is_live:
        return False
    theirs = fs.readlink(f"proc/{pid}/ns/net")  # "net:[4026531840]", namespaces(7)
    return theirs is not None and theirs == fs.readlink("proc/thread-self/ns/net")


def stream_listeners(fs: HostFS, pid: int) -> list[Listener]:
    """LISTEN rows of `/proc/<pid>/net/tcp{,6}`, read line by line with no cap.

    The tables list every socket of the namespace (TIME_WAIT too), so they
    outgrow any read cap on a busy host; only the few LISTEN rows are kept.
    A table that is gone (the process exited) reads as no rows.
    """
    out: list[Listener] = []
    for table in ("tcp", "tcp6"):
        try:
            for line in fs.iter_lines(f"proc/{pid}/net/{table}"):
                # Cheap pre-filter: the state column follows the remote address.
                if f" {TCP_LISTEN} " in line and (row := parse_listener_line(line)) is not None:
                    out.append(row)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


class ListenerSource:
    """Where this process gets listeners from: sock_diag until the kernel refuses
    or fails it once, then the /proc tables for the rest of the process's life.

    A refusal is a property of the process (its seccomp filter, its LSM label),
    so asking again at every probe would only fail again: one per process
    (`LISTENERS`), and one log line each time the path in use changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.refused: str | None = None  # why sock_diag is not used, once refused
        self._said: str | None = None  # the path last logged

    def read(self, fs: HostFS, pid: int) -> list[Listener]:
        """LISTEN sockets in `pid`'s network namespace ([] once it is gone).

        The kernel is asked for the listeners alone over sock_diag, whatever the
        number of other sockets: in the supervisor's own namespace (the usual
        case), or from a thread that joins the engine's. Where neither can be (a
        fixture tree, no CAP_SYS_ADMIN, sock_diag refused or failed), the /proc
        tables are streamed. Raises OSError for a shortage (EMFILE), not a refusal.
        """
        if not fs.is_live or self.refused is not None:
            return stream_listeners(fs, pid)
        try:
            if same_netns(fs, pid):
                found = dump_tcp_listeners()
            else:
                try:
                    found = dump_tcp_listeners_in(fs.path(f"proc/{pid}/ns/net"))
                except SockDiagUnavailable:
                    raise
                except OSError:
                    # No CAP_SYS_ADMIN for setns(2), a link we may not open (another
                    # user's process): that engine's table, streamed; sock_diag stays.
                    return stream_listeners(fs, pid)
        except SockDiagUnavailable as err:
            with self._lock:
                self.refused = str(err)
            self._say("/proc/<pid>/net/tcp{,6}", str(err))
            return stream_listeners(fs, pid)
        self._say("sock_diag", None)
        return [Listener(s.address, s.port, s.inode) for s in found]

    def _say(self, path: str, reason: str | None) -> None:
        with self._lock:
            if self._said == path:
                return
            self._said = path
        action = "stream the table from now on" if reason else "ask the kernel for listeners"
        log.log(
            logging.WARNING if reason else logging.INFO,
            "listener source %s",
            format_fields(path=path, reason=reason or "-", action=action),
        )


# One per process: see ListenerSource.
LISTENERS = ListenerSource()


def read_listeners(fs: HostFS, pid: int) -> list[Listener]:
    """`LISTENERS.read`: LISTEN sockets in `pid`'s network namespace."""
    return LISTENERS.read(fs, pid)


def tree_pids(fs: HostFS, root: int) -> list[int]:
    """`root` and every live descendant (parent links from /proc/<pid>/stat)."""
    children = children_map(scan_procs(fs))
    out: list[int] = []
    seen: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def socket_inodes(fs: HostFS, pid: int) -> set[int]:
    """Inodes of the sockets `pid` holds open (from its fd links)."""
    out: set[int] = set()
    for fd in fs.listdir(f"proc/{pid}/fd"):
        target = fs.readlink(f"proc/{pid}/fd/{fd}")
        if target is not None and target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def check_listener_owner(fs: HostFS, pid: int, host: str, port: int) -> str | None:
    """None when a socket listening for host:port belongs to `pid` or a
    descendant; else why not (nothing listens, or another process does)."""
    wanted = {lst.inode for lst in read_listeners(fs, pid) if serves(lst, host, port)}
    if not wanted:
        return f"nothing listens on port {port}"
    for member in tree_pids(fs, pid):
        if socket_inodes(fs, member) & wanted:
            return None
    fds = fs.listdir(f"proc/{pid}/fd")
    if fs.exists(f"proc/{pid}") and all(fs.readlink(f"proc/{pid}/fd/{fd}") is None for fd in fds):
        # Every live process holds some fd: no listing, or no link readable
        # (listing needs only DAC; each link needs ptrace access), is a refusal.
        return (
            f"cannot read the open files of pid {pid} to see who listens on port {port} "
            "(another user's process: the supervisor needs CAP_SYS_PTRACE)"
        )
    return (
        f"port {port} is held by a process outside the engine's tree "
        f"(pid {pid} and its children hold no listener there)"
    )
