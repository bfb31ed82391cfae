"""The API's address: "HOST:PORT" or "unix:PATH", parsed for both ends (pure, no I/O).

The server (`supervisor.serve.server`) binds it; the client (`supervisor.serve.status`) connects
to it. The config keeps the parsed `Listen` (api.listen); `config.check_listen`
validates a --listen value with the same parser.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Listen:
    """A TCP host and port, or a unix socket path (then host is None)."""

    host: str | None = None
    port: int = 0
    path: str | None = None

    @property
    def is_unix(self) -> bool:
        return self.path is not None

    def connect_host(self) -> str:
        """Where a client on this host connects: a wildcard address means loopback."""
        if self.host in ("", "0.0.0.0", "*"):
            return "127.0.0.1"
        if self.host == "::":
            return "::1"
        return self.host or "127.0.0.1"

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        host = self.host or ""
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


def parse_listen(text: str, where: str = "listen") -> Listen:
    """Parse "127.0.0.1:9477", "[::1]:9477", "localhost:0" or "unix:/run/x.sock".

    Raises ConfigError naming `where` and the value.
    """
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if not path:
            raise ConfigError(f"{where}: unix socket path is empty in {text!r}")
        return Listen(path=path)
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # IPv6 literal, RFC 3986 style
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{where}: expected HOST:PORT or unix:PATH, got {text!r}")
    return Listen(host=host, port=int(port))
