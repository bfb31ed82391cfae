"""One unary gRPC call over HTTP/2 without TLS on a unix socket (the kubelet's Pod Resources).

None of the daemon's packages speaks HTTP/2, and the call is one request and
one answer: this is the least of HTTP/2 (RFC 9113) a unary call needs. The
client sends the connection preface and its SETTINGS (no push, a 16 MiB stream
window, the connection window raised to match), one HEADERS and one DATA frame
on stream 1, answers the server's SETTINGS and PINGs, and reads HEADERS,
CONTINUATION and DATA of stream 1 until END_STREAM. The gRPC status is the
trailers' `grpc-status` (or the only HEADERS frame's, a "trailers-only" answer:
the gRPC over HTTP/2 protocol, doc/PROTOCOL-HTTP2.md in grpc/grpc). Messages
are length-prefixed, uncompressed (the call offers no `grpc-accept-encoding`).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass

from supervisor.agent.hpack import Decoder, HpackError, encode_headers
from supervisor.errors import SupervisorError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x4
WINDOW = 1 << 24  # what the answer may send before a WINDOW_UPDATE: all of it
DEFAULT_WINDOW = 65_535
MAX_ANSWER = 16 << 20  # a node's pod list is some KiB; past this the answer is refused
STREAM = 1


class GrpcError(SupervisorError):
    """The call failed: the socket, the HTTP/2 exchange, or a non-zero grpc-status."""


@dataclass(frozen=True, slots=True)
class Frame:
    type: int
    flags: int
    stream: int
    payload: bytes


def frame(type_: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([type_, flags])
        + struct.pack(">I", stream & 0x7FFFFFFF)
        + payload
    )


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    head = await reader.readexactly(9)
    length = int.from_bytes(head[:3], "big")
    if length > MAX_ANSWER:
        raise GrpcError(f"a frame of {length} bytes")
    stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
    return Frame(head[3], head[4], stream, await reader.readexactly(length))


def header_fragment(f: Frame) -> bytes:
    """The header block fragment of a HEADERS frame: padding and priority taken off."""
    body = f.payload
    pad = 0
    if f.flags & PADDED:
        pad, body = body[0], body[1:]
    if f.flags & PRIORITY_FLAG:
        body = body[5:]
    return body[: len(body) - pad] if pad else body


def data_payload(f: Frame) -> bytes:
    if f.flags & PADDED and f.payload:
        pad = f.payload[0]
        return f.payload[1 : len(f.payload) - pad]
    return f.payload


def grpc_messages(body: bytes) -> list[bytes]:
    """The length-prefixed messages of a gRPC body (a compressed one is refused)."""
    out: list[bytes] = []
    i = 0
    while i < len(body):
        if i + 5 > len(body):
            raise GrpcError("the answer ends inside a message's prefix")
        compressed, length = body[i], int.from_bytes(body[i + 1 : i + 5], "big")
        if compressed:
            raise GrpcError("the answer is compressed, which was not offered")
        if i + 5 + length > len(body):
            raise GrpcError("the answer ends inside a message")
        out.append(body[i + 5 : i + 5 + length])
        i += 5 + length
    return out


async def unary_call(socket_path: str, method: str, request: bytes, timeout_s: float) -> bytes:
    """The answer message of `method` ("/v1.PodResourcesLister/List") called with
    `request` (an encoded protobuf message) on the server at `socket_path`."""
    try:
        return await asyncio.wait_for(_call(socket_path, method, request), timeout_s)
    except TimeoutError:
        raise GrpcError(f"{socket_path}: no answer within {timeout_s:g} s") from None
    except (OSError, asyncio.IncompleteReadError) as err:
        text = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise GrpcError(f"{socket_path}: {text}") from None
    except HpackError as err:
        raise GrpcError(f"{socket_path}: a header block: {err}") from None


async def _call(socket_path: str, method: str, request: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(socket_path)
    try:
        settings = struct.pack(">HI", SETTINGS_ENABLE_PUSH, 0)
        settings += struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, WINDOW)
        headers = encode_headers(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", method),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
        )
        message = b"\x00" + struct.pack(">I", len(request)) + request
        writer.write(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", WINDOW - DEFAULT_WINDOW))
            + frame(HEADERS, END_HEADERS, STREAM, headers)
            + frame(DATA, END_STREAM, STREAM, message)
        )
        await writer.drain()
        return await _answer(reader, writer, socket_path)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: str) -> bytes:
    decoder = Decoder()
    blocks: list[list[tuple[str, str]]] = []
    fragment: bytearray | None = None  # a header block still waiting for END_HEADERS
    ends = False
    body = bytearray()
    while True:
        f = await read_frame(reader)
        if fragment is not None and f.type != CONTINUATION:
            raise GrpcError(f"{where}: frame type {f.type} inside a header block")
        if f.type == SETTINGS and not f.flags & ACK:
            writer.write(frame(SETTINGS, ACK, 0))
        elif f.type == PING and not f.flags & ACK:
            writer.write(frame(PING, ACK, 0, f.payload))
        elif f.type == GOAWAY:
            code = int.from_bytes(f.payload[4:8], "big") if len(f.payload) >= 8 else -1
            raise GrpcError(
                f"{where}: the server went away (HTTP/2 error {code}): {f.payload[8:]!r}"
            )
        elif f.type == RST_STREAM and f.stream == STREAM:
            raise GrpcError(
                f"{where}: the call was reset (HTTP/2 error {int.from_bytes(f.payload, 'big')})"
            )
        elif f.type in (HEADERS, CONTINUATION) and f.stream == STREAM:
            if f.type == HEADERS:
                fragment = bytearray(header_fragment(f))
                ends = bool(f.flags & END_STREAM)
            elif fragment is None:
                raise GrpcError(f"{where}: CONTINUATION without HEADERS")
            else:
                fragment += f.payload
            if f.flags & END_HEADERS:
                blocks.append(decoder.decode(bytes(fragment)))
                fragment = None
                if ends:
                    break
        elif f.type == DATA and f.stream == STREAM:
            body += data_payload(f)
            if len(body) > MAX_ANSWER:
                raise GrpcError(f"{where}: an answer over {MAX_ANSWER} bytes")
            if f.flags & END_STREAM:
                break
        await writer.drain()
    return _result(blocks, bytes(body), where)


def _result(blocks: list[list[tuple[str, str]]], body: bytes, where: str) -> bytes:
    """The one answer message, once the status says it is one."""
    if not blocks:
        raise GrpcError(f"{where}: the answer has no headers")
    first = dict(blocks[0])
    if first.get(":status") != "200":
        raise GrpcError(f"{where}: HTTP status {first.get(':status')}")
    trailers = dict(blocks[-1])
    status = trailers.get("grpc-status")
    if status is None:
        raise GrpcError(f"{where}: the answer ended without a grpc-status")
    if status != "0":
        message = trailers.get("grpc-message", "")
        raise GrpcError(f"{where}: grpc-status {status}: {message}".rstrip(": "))
    messages = grpc_messages(body)
    if len(messages) != 1:
        raise GrpcError(f"{where}: {len(messages)} answer messages to a unary call")
    return messages[0]
