"""A fake irqbalance for tests: its control socket under a fixture root, as a thread.

Does I/O: binds a unix socket and serves it from a daemon thread until
`close()`. Speaks what supervisor.bind.irq needs of irqbalance's protocol.
"""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path


class FakeIrqbalance:
    """A unix-socket server speaking irqbalance's control protocol (irqbalance.c
    sock_handle): one request per connection, SCM_CREDENTIALS with uid 0 required."""

    def __init__(self, path: str) -> None:
        self.requests: list[tuple[str, int | None]] = []
        self.banned: list[int] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(path)
        self.sock.listen(4)
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                msg, anc, _, _ = conn.recvmsg(500, socket.CMSG_SPACE(12))
                uid = None
                for level, kind, data in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                        uid = struct.unpack("3i", data[:12])[1]
                text = msg.decode()
                self.requests.append((text, uid))
                if uid != 0:
                    continue
                if text.startswith("settings ban irqs "):
                    rest = text.removeprefix("settings ban irqs ")
                    self.banned = [] if rest.startswith("NONE") else [int(w) for w in rest.split()]
                elif text.startswith("setup"):
                    irqs = "".join(f"IRQ {i} LOAD 0 DIFF 0 CLASS 3 " for i in self.banned)
                    conn.sendall(f"SLEEP 10 {irqs}BANNED 00000000".encode())

    def close(self) -> None:
        self.sock.close()


def serve_fake_irqbalance(root: Path, pid: int = 4321) -> FakeIrqbalance:
    """An "irqbalance" process `pid` in the tree at `root` (its /proc/<pid>/comm),
    answering on run/irqbalance/irqbalance<pid>.sock as irqbalance would."""
    (root / f"proc/{pid}").mkdir(parents=True)
    (root / f"proc/{pid}/comm").write_text("irqbalance\n")
    (root / "run/irqbalance").mkdir(parents=True)
    return FakeIrqbalance(str(root / f"run/irqbalance/irqbalance{pid}.sock"))
