"""The running messages' bytes (`protocol/running_wire.py`) parse to the message the handler
builds, for TextGenerate and Generate, whatever the text and ids."""

from __future__ import annotations

from meshlm.gateway.protocol.meta_info import running_meta
from meshlm.gateway.protocol.running_wire import RunningEncoder, varint
from sglang.runtime.v1 import sglang_pb2 as pb

ITEMS = [
    ("r1", [5], 17, 2, 0, " word"),
    ("r1", [127, 128, 300, 2**31 - 1], 17, 6, 0, "héllo ✓ 🙂"),  # varints of 1 to 5 bytes
    ("r1", [], 17, 6, 0, "held text only"),
    ("r1", [9], 17, 7, 0, ""),  # text held back (a partial character, a stop string's start)
    ("r1", [9], 20, 8, 16, "x" * 300),  # the kept entries change; a length over one byte
    ("another-rid", [1], 3, 1, 0, "y"),
]


def test_varints_are_protobufs() -> None:
    for n in (0, 1, 127, 128, 16383, 16384, 2**31 - 1):
        data = varint(n)  # as output_ids' packed payload, after its tag and length
        assert pb.GenerateResponse.FromString(b"\x0a" + bytes([len(data)]) + data
                                              ).output_ids == [n]


def test_text_generate_running_messages_parse_to_the_handlers_message() -> None:
    encode = RunningEncoder(text=True)
    for rid, ids, prompt, completion, cached, text in ITEMS:
        expected = pb.TextGenerateResponse(text=text, output_ids=ids, meta_info=running_meta(
            rid, prompt, completion, cached))
        got = pb.TextGenerateResponse.FromString(
            encode((rid, ids, prompt, completion, cached, text)))
        assert got == expected


def test_generate_running_messages_carry_ids_and_no_text() -> None:
    encode = RunningEncoder(text=False)
    for rid, ids, prompt, completion, cached, text in ITEMS:
        expected = pb.GenerateResponse(output_ids=ids, meta_info=running_meta(
            rid, prompt, completion, cached))
        got = pb.GenerateResponse.FromString(encode((rid, ids, prompt, completion, cached, text)))
        assert got == expected
