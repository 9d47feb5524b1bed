"""TextGenerate's and Generate's running messages (text, ids and the four meta_info counts of a
one-sample request without logprobs, not finished) encoded straight into protobuf's wire
format, for the direct writes (`api/direct.py`): building the message object, filling its
meta_info map and serializing it cost about three times as much. Parsed, the bytes are the
message the handler builds (`tests/unit/gateway/protocol/test_running_wire.py`); protobuf
takes fields in any order and a map's entries one by one.
"""

from __future__ import annotations

from meshlm.common.packed import Plain

_TEXT = b"\x0a"  # TextGenerateResponse.text: field 1, length-delimited
_META = b"\x12"  # meta_info (both messages): field 2, a length-delimited map entry
_IDS = {True: b"\xa2\x06",  # TextGenerateResponse.output_ids: field 100, packed varints
        False: b"\x0a"}     # GenerateResponse.output_ids: field 1


_BYTE = [bytes((i,)) for i in range(0x80)]  # the varints of one byte
# A completion_tokens entry up to its value, by the value's length (1 to 20 digits).
_COMPLETION = {n: b"\x12" + _BYTE[21 + n] + b"\x0a\x11completion_tokens\x12" + _BYTE[n]
               for n in range(1, 21)}


def varint(n: int) -> bytes:
    """`n` (>= 0) as a protobuf varint."""
    if n < 0x80:
        return _BYTE[n]
    if n < 0x4000:  # most token ids
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, data: bytes) -> bytes:
    return tag + varint(len(data)) + data


def meta_entry(key: bytes, value: bytes) -> bytes:
    """One meta_info entry: a map entry message of key (1) and value (2)."""
    return _field(_META, _field(b"\x0a", key) + _field(b"\x12", value))


class RunningEncoder:
    """One call's running messages: TextGenerateResponse's (`text`) or GenerateResponse's.
    The entries that stay the same from message to message (id, prompt and cached tokens)
    are encoded once and kept."""

    def __init__(self, text: bool) -> None:
        self._text = text
        self._ids_tag = _IDS[text]
        self._rid = ""
        self._prompt = self._cached = -1
        self._fixed = b""

    def __call__(self, item: Plain) -> bytes:
        rid, ids, prompt, completion, cached, text = item
        if prompt != self._prompt or cached != self._cached or rid != self._rid:
            self._rid, self._prompt, self._cached = rid, prompt, cached
            self._fixed = (meta_entry(b"id", rid.encode()) + meta_entry(b"prompt_tokens",
                                                                         b"%d" % prompt)
                           + meta_entry(b"cached_tokens", b"%d" % cached))
        count = b"%d" % completion
        parts = [self._fixed, _COMPLETION[len(count)], count]
        if text and self._text:
            data = text.encode()
            size = len(data)
            parts += (_TEXT, _BYTE[size] if size < 0x80 else varint(size), data)
        if ids:
            packed = varint(ids[0]) if len(ids) == 1 else b"".join(varint(i) for i in ids)
            parts += (self._ids_tag, varint(len(packed)), packed)
        return b"".join(parts)
