"""A tiny systemd notification client (sd_notify(3) protocol; does socket I/O).

systemd passes `NOTIFY_SOCKET` (a path, or "@name" for the abstract
namespace) to a Type=notify service; the service sends newline-separated
KEY=VALUE datagrams: READY=1, STATUS=..., WATCHDOG=1, STOPPING=1, and
RELOADING=1 (with MONOTONIC_USEC) before a config reload's READY=1. Without the
variable every call is a no-op, so the daemon runs the same outside systemd.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("placement_supervisor.sdnotify")


def parse_notify_address(value: str) -> str | bytes | None:
    """The sendto() address of a NOTIFY_SOCKET value (pure).

    "@name" is a Linux abstract socket: the address is the name with a leading
    NUL byte (unix(7), "abstract"). A relative path or other text is refused
    (None): systemd only ever passes an absolute path or an abstract name.
    """
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def watchdog_interval_s(env: Mapping[str, str], pid: int) -> float | None:
    """How often to send WATCHDOG=1: half of WatchdogSec, per sd_watchdog_enabled(3).

    None when the watchdog is off, the value is garbled, or WATCHDOG_PID names
    another process (the variables were inherited, not meant for us).
    """
    usec_text = env.get("WATCHDOG_USEC")
    if not usec_text:
        return None
    owner = env.get("WATCHDOG_PID")
    if owner:
        try:
            if int(owner) != pid:
                return None
        except ValueError:
            return None
    try:
        usec = int(usec_text)
    except ValueError:
        return None
    if usec <= 0:
        return None
    return usec / 1e6 / 2


class Notifier:
    """Sends sd_notify datagrams to one socket; a no-op without one.

    Sends never block (the socket is non-blocking) and never raise: systemd
    being gone or the socket full is logged once and the daemon carries on.
    """

    def __init__(self, address: str | bytes | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Notifier:
        value = env.get("NOTIFY_SOCKET")
        return cls(parse_notify_address(value) if value else None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str) -> bool:
        """Send one datagram of KEY=VALUE lines; True when the kernel took it."""
        if self.address is None:
            return False
        payload = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(payload, self.address)
        except OSError as err:
            if not self._warned:
                log.warning(
                    "sd_notify failed socket=%r errno=%s action=continue",
                    self.address,
                    err.strerror or err,
                )
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        if status is None:
            return self.send(READY="1")
        return self.send(READY="1", STATUS=status)

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG="1")

    def reloading(self, status: str, monotonic_usec: int | None = None) -> bool:
        """RELOADING=1 with MONOTONIC_USEC (CLOCK_MONOTONIC now, in µs): sd_notify(3)
        asks for both, and Type=notify-reload (systemd 253+) refuses a
        RELOADING=1 without the timestamp. READY=1 ends the reload."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(
            RELOADING="1",
            MONOTONIC_USEC=str(usec if monotonic_usec is None else monotonic_usec),
            STATUS=status,
        )

    def stopping(self, status: str | None = None) -> bool:
        if status is None:
            return self.send(STOPPING="1")
        return self.send(STOPPING="1", STATUS=status)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
