"""A request whose constraint is large is checked (its grammar built) on a worker thread, so
the gateway's event loop keeps serving other streams meanwhile; a small one where it is; a
grammar once built is kept for the same constraint, a refusal is not."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.api.generation import validated
from meshlm.gateway.protocol.constraints import (
    INLINE_CONSTRAINT_BYTES,
    json_schema_grammar,
    large_constraint,
)
from sglang.runtime.v1 import sglang_pb2 as pb


def _schema(properties: int) -> str:
    return json.dumps({"type": "object",
                       "properties": {f"p{i}": {"type": "string"} for i in range(properties)}})


def test_large_means_more_than_the_inline_bound_in_any_spelling() -> None:
    assert not large_constraint(pb.SamplingParams())
    assert not large_constraint(pb.SamplingParams(json_schema=_schema(10)))
    big = _schema(200)
    assert len(big) > INLINE_CONSTRAINT_BYTES
    assert large_constraint(pb.SamplingParams(json_schema=big))
    assert large_constraint(pb.SamplingParams(regex="a" * (INLINE_CONSTRAINT_BYTES + 1)))
    assert large_constraint(pb.SamplingParams(
        guided_decoding=pb.GuidedDecoding(choice=pb.ChoiceConstraint(values=["x" * 3000]))))


async def test_a_large_constraint_is_checked_off_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def check(p: pb.SamplingParams) -> str:
        seen.append(threading.get_ident())
        return json_schema_grammar(p.json_schema, "json_schema")

    small = pb.SamplingParams(json_schema=_schema(5))
    assert await validated(check, small, small)
    big = pb.SamplingParams(json_schema=_schema(400))
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.ensure_future(tick())
    try:
        assert await validated(check, big, big)
    finally:
        ticker.cancel()
    assert seen[0] == loop_thread and seen[1] != loop_thread
    assert ticks > 0  # the loop ran while the grammar was built


def test_built_grammars_are_kept_and_refusals_are_not() -> None:
    schema = _schema(7)
    assert json_schema_grammar(schema, "f") is json_schema_grammar(schema, "f")
    before = json_schema_grammar.cache_info().currsize
    for _ in range(2):
        with pytest.raises(MeshError):
            json_schema_grammar('{"type": "nonsense"}', "f")
    assert json_schema_grammar.cache_info().currsize == before
