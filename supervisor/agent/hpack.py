"""HPACK (RFC 7541): header blocks encoded for, and decoded from, one HTTP/2 peer (pure).

Just what one gRPC call to the kubelet needs (supervisor.agent.grpc_unix): the
request's headers go out as literals without indexing and without Huffman coding
(always valid, RFC 7541 §6.2.2), and the response's headers and trailers come in
in any form a server may choose: indexed, literal, Huffman-coded, with dynamic
table updates (Go's HTTP/2 server, the kubelet's, indexes and Huffman-codes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from supervisor.errors import SupervisorError


class HpackError(SupervisorError):
    """A header block this decoder cannot read (the connection is then unusable)."""


# RFC 7541 Appendix A: index 1..61.
STATIC_TABLE: tuple[tuple[str, str], ...] = (
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
)

# RFC 7541 Appendix B's code lengths in bits, symbol 0..256 (EOS), one base-36 digit
# each. The code is canonical (codes of one length are consecutive in symbol order,
# each length's first code follows the last shorter one's), so the lengths are all
# of it: HUFFMAN is built from them below (tests/agent/test_hpack.py checks the
# result against another implementation's table, code by code).
_LENGTHS = (
    "dnsssssssoussussssssssusssssssss6aacd68baa8b8666555666666678f6ca"
    "d67777777777777777777777878djde6f56565666577666567655677777fbeds"
    "kmkkmmmnmnnnnnonoomnonnnnlmnmnnomlkmmnnlnmmolmnnllmlnmnnkmmmnmmn"
    "qqkjmnmpqqqrrqopjlqrrqrollqqsrrrkoklmllnmmppooqnqrqqrrrrrsrrrrrq"
    "u"
)
EOS = 256


def canonical_codes(lengths: Iterable[int]) -> dict[int, tuple[int, int]]:
    """{symbol: (code, length)} of the canonical Huffman code of these lengths (pure)."""
    by_length = sorted((n, symbol) for symbol, n in enumerate(lengths))
    codes: dict[int, tuple[int, int]] = {}
    code, previous = 0, by_length[0][0]
    for i, (n, symbol) in enumerate(by_length):
        if i:
            code = (code + 1) << (n - previous)
        previous = n
        codes[symbol] = (code, n)
    return codes


HUFFMAN: Mapping[int, tuple[int, int]] = canonical_codes(int(c, 36) for c in _LENGTHS)
_DECODE: Mapping[tuple[int, int], int] = {(n, code): s for s, (code, n) in HUFFMAN.items()}


def huffman_decode(data: bytes) -> bytes:
    """RFC 7541 §5.2: the octets `data` codes; padding is at most 7 one bits."""
    out = bytearray()
    code = n = 0
    for byte in data:
        for shift in range(7, -1, -1):
            code = (code << 1) | ((byte >> shift) & 1)
            n += 1
            symbol = _DECODE.get((n, code))
            if symbol is None:
                if n > 30:
                    raise HpackError("Huffman string: no code matches")
                continue
            if symbol == EOS:
                raise HpackError("Huffman string: EOS inside the string")
            out.append(symbol)
            code = n = 0
    if n > 7 or code != (1 << n) - 1:
        raise HpackError("Huffman string: padding is not a prefix of EOS")
    return bytes(out)


def encode_integer(value: int, prefix_bits: int, flags: int) -> bytes:
    """RFC 7541 §5.1: `value` with an N-bit prefix, `flags` in the first octet's rest."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([flags | value])
    out = bytearray([flags | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_headers(headers: Iterable[tuple[str, str]]) -> bytes:
    """A header block of literals without indexing, names and values as they are."""
    out = bytearray()
    for name, value in headers:
        out.append(0x00)  # literal without indexing, a new name
        for text in (name.encode(), value.encode()):
            out += encode_integer(len(text), 7, 0x00) + text
    return bytes(out)


class Decoder:
    """One connection's decoding context: its dynamic table lives across blocks."""

    def __init__(self, max_size: int = 4096) -> None:
        self.table: list[tuple[str, str]] = []  # newest first
        self.size = 0
        self.max_size = max_size  # what SETTINGS_HEADER_TABLE_SIZE allows (4096: the default)
        self.limit = max_size  # what the encoder set last (§6.3), at most max_size

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        headers: list[tuple[str, str]] = []
        i = 0
        while i < len(block):
            first = block[i]
            if first & 0x80:  # §6.1 indexed
                index, i = _integer(block, i, 7)
                headers.append(self._entry(index))
            elif first & 0x40:  # §6.2.1 literal with incremental indexing
                header, i = self._literal(block, i, 6)
                headers.append(header)
                self._add(header)
            elif first & 0x20:  # §6.3 dynamic table size update
                size, i = _integer(block, i, 5)
                if size > self.max_size:
                    raise HpackError(f"table size update to {size} over {self.max_size}")
                self.limit = size
                self._evict()
            else:  # §6.2.2 / §6.2.3 literal without indexing / never indexed
                header, i = self._literal(block, i, 4)
                headers.append(header)
        return headers

    def _entry(self, index: int) -> tuple[str, str]:
        if index == 0:
            raise HpackError("index 0")
        if index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        dynamic = index - len(STATIC_TABLE) - 1
        if dynamic >= len(self.table):
            raise HpackError(f"index {index} past the dynamic table ({len(self.table)} entries)")
        return self.table[dynamic]

    def _literal(self, block: bytes, i: int, prefix_bits: int) -> tuple[tuple[str, str], int]:
        index, i = _integer(block, i, prefix_bits)
        if index:
            name = self._entry(index)[0]
        else:
            name, i = _string(block, i)
        value, i = _string(block, i)
        return (name, value), i

    def _add(self, header: tuple[str, str]) -> None:
        self.table.insert(0, header)
        self.size += _entry_size(header)
        self._evict()

    def _evict(self) -> None:
        while self.size > self.limit and self.table:
            self.size -= _entry_size(self.table.pop())


def _entry_size(header: tuple[str, str]) -> int:
    """§4.1: octets of name and value plus 32."""
    return len(header[0].encode()) + len(header[1].encode()) + 32


def _integer(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """(value, index past it) of the §5.1 integer at `block[i]`."""
    limit = (1 << prefix_bits) - 1
    value = block[i] & limit
    i += 1
    if value < limit:
        return value, i
    shift = 0
    while True:
        if i >= len(block):
            raise HpackError("integer runs past the block")
        byte = block[i]
        i += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i
        if shift > 28:
            raise HpackError("integer over 2^28")


def _string(block: bytes, i: int) -> tuple[str, int]:
    """(text, index past it) of the §5.2 string at `block[i]`."""
    if i >= len(block):
        raise HpackError("string runs past the block")
    huffman = bool(block[i] & 0x80)
    length, i = _integer(block, i, 7)
    if i + length > len(block):
        raise HpackError("string runs past the block")
    raw = block[i : i + length]
    data = huffman_decode(raw) if huffman else raw
    return data.decode("utf-8", "replace"), i + length
