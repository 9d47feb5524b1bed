"""Logprobs at the gateway: SGLang's meta_info shapes, merging in the mailbox and for
non-streaming replies, and real JSON arrays on the native /generate route."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from flat_api import FlatApi

from meshlm.common.rpc import CallContext
from meshlm.gateway.front.http_app import build_http_app
from meshlm.gateway.mesh.inbox import PendingRequest, Update
from meshlm.gateway.protocol.choices import merge_updates as _merge
from meshlm.gateway.protocol.logprob_meta import LOGPROB_KEYS, logprob_meta
from meshlm.gateway.protocol.native import native_generate_request
from meshlm.v1 import common_pb2, gateway_pb2
from sglang.runtime.v1 import sglang_pb2 as pb


def _top(ids: list[int], logprobs: list[float], texts: list[str] = ()) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=ids, logprobs=logprobs, texts=list(texts))


def _decoded(meta: dict[str, str]) -> dict[str, Any]:
    return {k: orjson.loads(v) for k, v in meta.items()}


def test_output_entries_are_logprob_id_text_triples() -> None:
    lp = common_pb2.Logprobs(output_logprobs=[-0.1, -2.5],
                             output_top=[_top([7, 3], [-0.1, -3.0]), _top([8, 7], [-2.5, -2.75])])
    meta = _decoded(logprob_meta([7, 8], lp, top=True, text=False))
    assert meta["output_token_logprobs"] == [[-0.1, 7, None], [-2.5, 8, None]]
    assert meta["output_top_logprobs"] == [[[-0.1, 7, None], [-3.0, 3, None]],
                                           [[-2.5, 8, None], [-2.75, 7, None]]]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []


def test_float32_values_are_written_short() -> None:
    meta = logprob_meta([1], common_pb2.Logprobs(output_logprobs=[-0.1]), top=False, text=False)
    assert meta["output_token_logprobs"] == "[[-0.1,1,null]]"  # not -0.10000000149011612


def test_top_keys_only_when_top_logprobs_were_asked() -> None:
    meta = logprob_meta([1], common_pb2.Logprobs(output_logprobs=[-1.0]), top=False, text=False)
    assert set(meta) == {"output_token_logprobs", "input_token_logprobs"}


def test_texts_when_asked() -> None:
    lp = common_pb2.Logprobs(output_logprobs=[-1.0], output_texts=[" the"],
                             output_top=[_top([5], [-1.0], [" the"])])
    meta = _decoded(logprob_meta([5], lp, top=True, text=True))
    assert meta["output_token_logprobs"] == [[-1.0, 5, " the"]]
    assert meta["output_top_logprobs"] == [[[-1.0, 5, " the"]]]


def test_prompt_position_0_has_null_logprob_and_null_top() -> None:
    lp = common_pb2.Logprobs(
        input_start=0, input_token_ids=[1, 20, 21], input_logprobs=[math.nan, -4.0, -0.5],
        input_texts=["<s>", " a", "b"],
        input_top=[_top([], []), _top([9], [-1.0], ["x"]), _top([21], [-0.5], ["b"])])
    meta = _decoded(logprob_meta([], lp, top=True, text=True))
    assert meta["input_token_logprobs"] == [[None, 1, "<s>"], [-4.0, 20, " a"], [-0.5, 21, "b"]]
    assert meta["input_top_logprobs"] == [None, [[-1.0, 9, "x"]], [[-0.5, 21, "b"]]]
    # From a later start, the first entry is a real one.
    lp = common_pb2.Logprobs(input_start=2, input_token_ids=[21], input_logprobs=[-0.5],
                             input_top=[_top([21], [-0.5])])
    meta = _decoded(logprob_meta([], lp, top=True, text=False))
    assert meta["input_token_logprobs"] == [[-0.5, 21, None]]
    assert meta["input_top_logprobs"] == [[[-0.5, 21, None]]]


def test_nothing_arrived_gives_empty_lists() -> None:
    meta = _decoded(logprob_meta([4, 5], None, top=True, text=True, asked=True))
    assert meta == {k: [] for k in LOGPROB_KEYS}


async def test_mailbox_merges_logprobs_with_their_tokens() -> None:
    req = PendingRequest(rid="r", tokenizer="t", scheduler="s", detokenizer="d", started_at=0)
    first = common_pb2.Logprobs(output_logprobs=[-1.0], input_start=1, input_token_ids=[5],
                                input_logprobs=[-2.0])
    req.deliver(gateway_pb2.TextOutput(rid="r", token_ids=[7], logprobs=first))
    req.deliver(gateway_pb2.TextOutput(rid="r", token_ids=[8], logprobs=common_pb2.Logprobs(
        output_logprobs=[-3.0])))
    update = await req.next()
    assert update.token_ids == [7, 8] and update.logprobs is not None
    assert list(update.logprobs.output_logprobs) == [-1.0, -3.0]
    assert update.logprobs.input_start == 1 and list(update.logprobs.input_token_ids) == [5]
    req.deliver(gateway_pb2.TextOutput(rid="r", token_ids=[9]))
    assert (await req.next()).logprobs is None  # taken with the previous update


def test_non_streaming_merge_keeps_every_entry() -> None:
    def update(ids: list[int], lp: common_pb2.Logprobs | None) -> Update:
        return Update("", ids, None, None, 3, len(ids), 0, logprobs=lp)

    merged = _merge([update([1], common_pb2.Logprobs(output_logprobs=[-1.0], input_start=2,
                                                     input_logprobs=[-0.5])),
                     update([], None),
                     update([2, 3], common_pb2.Logprobs(output_logprobs=[-2.0, -3.0]))])
    assert merged.token_ids == [1, 2, 3] and merged.logprobs is not None
    assert list(merged.logprobs.output_logprobs) == [-1.0, -2.0, -3.0]
    assert merged.logprobs.input_start == 2
    assert _merge([update([1], None)]).logprobs is None


def test_native_body_accepts_logprob_options() -> None:
    text = native_generate_request(orjson.dumps({
        "text": "hi", "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
        "return_text_in_logprobs": True}))
    assert isinstance(text, pb.TextGenerateRequest)
    assert text.return_logprob and text.top_logprobs_num == 2 and text.logprob_start_len == 0
    assert text.return_text_in_logprobs
    ids = native_generate_request(orjson.dumps({
        "input_ids": [1, 2], "return_logprob": True, "return_text_in_logprobs": True}))
    assert isinstance(ids, pb.GenerateRequest) and ids.return_text_in_logprobs


class _Api:
    """TextGenerate (and `generated`, /generate's reading of it) streams two tokens with
    logprobs, as GatewayAPI formats them."""

    def TextGenerate(self, req: pb.TextGenerateRequest, ctx: CallContext,
                     express: object = None) -> AsyncIterator[pb.TextGenerateResponse]:
        return self._stream(req)

    generated = TextGenerate

    async def _stream(self, req: pb.TextGenerateRequest) -> AsyncIterator[pb.TextGenerateResponse]:
        first = common_pb2.Logprobs(output_logprobs=[-0.5], output_top=[_top([7], [-0.5])],
                                    input_start=0, input_token_ids=[1, 2],
                                    input_logprobs=[math.nan, -1.5],
                                    input_top=[_top([], []), _top([2], [-1.5])])
        second = common_pb2.Logprobs(output_logprobs=[-0.25], output_top=[_top([8], [-0.25])])
        parts = [("a", [7], first), ("b", [8], second)]
        if not req.stream:
            merged = common_pb2.Logprobs()
            merged.MergeFrom(first)
            merged.MergeFrom(second)
            parts = [("ab", [7, 8], merged)]
        for i, (text, ids, lp) in enumerate(parts):
            last = i == len(parts) - 1
            meta = {"id": "r", "prompt_tokens": "2", "completion_tokens": str(i + 1),
                    "cached_tokens": "0", **logprob_meta(ids, lp, top=True, text=False)}
            if last:
                meta["finish_reason"] = "length"
            yield pb.TextGenerateResponse(text=text, output_ids=ids, meta_info=meta,
                                          finished=last)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_http_app(FlatApi(_Api())))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c


WHOLE = {
    "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
    "output_top_logprobs": [[[-0.5, 7, None]], [[-0.25, 8, None]]],
    "input_token_logprobs": [[None, 1, None], [-1.5, 2, None]],
    "input_top_logprobs": [None, [[-1.5, 2, None]]],
}


async def test_native_generate_returns_json_arrays(client: httpx.AsyncClient) -> None:
    body = {"text": "hi", "return_logprob": True, "top_logprobs_num": 1, "logprob_start_len": 0}
    meta = (await client.post("/generate", json=body)).json()["meta_info"]
    assert {k: meta[k] for k in WHOLE} == WHOLE


async def test_native_sse_logprobs_are_cumulative_like_the_text(
        client: httpx.AsyncClient) -> None:
    body = {"text": "hi", "stream": True, "return_logprob": True, "top_logprobs_num": 1}
    r = await client.post("/generate", json=body)
    events = [orjson.loads(c[len(b"data: "):]) for c in r.content.split(b"\n\n")[:-2]]
    assert [e["text"] for e in events] == ["a", "ab"]
    assert [len(e["meta_info"]["output_token_logprobs"]) for e in events] == [1, 2]
    assert {k: events[-1]["meta_info"][k] for k in WHOLE} == WHOLE


async def test_transcoded_route_keeps_meta_info_strings(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/runtime/text_generate", json={"text": "hi", "stream": True})
    lines = [orjson.loads(x)["result"] for x in r.content.splitlines()]
    deltas = [orjson.loads(x["meta_info"]["output_token_logprobs"]) for x in lines]
    assert deltas == [[[-0.5, 7, None]], [[-0.25, 8, None]]]
