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


def varint(n: int) -> bytes:
    """`n` (>= 0) as a protobuf varint."""
    if n < 0x80:
        return bytes((n,))
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
        self._kept: tuple[str, int, int] | None = None
        self._fixed = b""

    def __call__(self, item: Plain) -> bytes:
        rid, ids, prompt, completion, cached, text = item
        if self._kept != (rid, prompt, cached):
            self._kept = (rid, prompt, cached)
            self._fixed = (meta_entry(b"id", rid.encode()) + meta_entry(b"prompt_tokens",
                                                                         b"%d" % prompt)
                           + meta_entry(b"cached_tokens", b"%d" % cached))
        out = self._fixed + meta_entry(b"completion_tokens", b"%d" % completion)
        if text and self._text:
            out += _field(_TEXT, text.encode())
        if ids:
            packed = (varint(ids[0]) if len(ids) == 1
                      else b"".join(varint(i) for i in ids))
            out += _field(self._ids_tag, packed)
        return out
