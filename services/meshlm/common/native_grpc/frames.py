"""HTTP/2 framing as gRPC uses it (RFC 9113): frame types, flags, settings, and the few HPACK
encodings a gRPC peer needs to write (literal fields, never indexed, no Huffman coding).

Decoding a peer's header blocks (Huffman strings, the dynamic table) is HPACK's library's
work; writing them is this module's: a literal field costs nothing to build and every decoder
reads it.
"""

from __future__ import annotations

from collections.abc import Callable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)

END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# SETTINGS identifiers
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = range(1, 7)

# Error codes (RST_STREAM, GOAWAY)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, STREAM_CLOSED, \
    FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = range(10)
ENHANCE_YOUR_CALM = 0xB

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384


class FrameSizeError(ValueError):
    """A frame longer than this end allows (DEFAULT_FRAME_SIZE: it advertises no larger)."""


def split(buf: bytes, at: int, on_frame: Callable[[int, int, int, bytes], None]) -> int:
    """Hand each whole frame of `buf[at:]` to `on_frame(type, flags, stream, payload)`; returns
    where the rest (a frame not yet whole) starts."""
    end = len(buf)
    while end - at >= 9:
        length = int.from_bytes(buf[at:at + 3], "big")
        if length > DEFAULT_FRAME_SIZE:
            raise FrameSizeError(f"a frame of {length} bytes")
        if end - at - 9 < length:
            break
        start = at + 9
        at = start + length
        on_frame(buf[start - 6], buf[start - 5],
                 int.from_bytes(buf[start - 4:start], "big") & MAX_WINDOW, buf[start:at])
    return at


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream.to_bytes(4, "big") + payload)


def settings(pairs: dict[int, int]) -> bytes:
    """A SETTINGS frame's payload."""
    return b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs.items())


def hpack_int(n: int, prefix_bits: int = 7, first: int = 0) -> bytes:
    """An HPACK integer with an N-bit prefix; `first` holds the first byte's other bits."""
    limit = (1 << prefix_bits) - 1
    if n < limit:
        return bytes((first | n,))
    out = bytearray((first | limit,))
    n -= limit
    while n >= 128:
        out.append(n % 128 + 128)
        n //= 128
    out.append(n)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """One header field, literal never indexed, new name, no Huffman coding."""
    return b"\x10" + hpack_int(len(name)) + name + hpack_int(len(value)) + value


def grpc_message(text: str) -> bytes:
    """gRPC's percent-encoding of a status message: UTF-8, with '%' and every byte outside
    printable ASCII written %XX."""
    out = bytearray()
    for b in text.encode("utf-8", "replace"):
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += b"%%%02X" % b
    return bytes(out)


class Partial:
    """The start of a call's next gRPC message while the rest of it has not come: kept as
    the DATA payloads it came in and joined once the message is whole, so reading a message
    costs time linear in its size (joining at every payload made a 40 MB message cost
    seconds). A reader takes `join(data)` as the bytes to parse (None: still short of the
    message) and `keep(buf, at)` what it did not parse."""

    __slots__ = ("parts", "have", "need")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.have = 0  # bytes in parts
        self.need = 0  # bytes the next message takes, its 5-byte prefix included

    def join(self, data: bytes) -> bytes | None:
        if not self.parts:
            return data
        self.parts.append(data)
        self.have += len(data)
        if self.have < self.need:
            return None
        buf = b"".join(self.parts)
        self.parts = []
        return buf

    def keep(self, buf: bytes, at: int) -> None:
        if at < len(buf):
            rest = buf[at:] if at else buf
            self.parts = [rest]
            self.have = len(rest)
            self.need = 5 + int.from_bytes(rest[1:5], "big") if len(rest) >= 5 else 5
