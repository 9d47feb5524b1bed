"""The tokenizer's Submit stream over fake schedulers: a big prompt is tokenized as a job of its
own, so the small requests behind it on the same stream are forwarded first; one that cannot
fit the context is refused (counted piece by piece), the others go on. ApplyChatTemplate with
the final message left open, and its refusals naming "messages"; a chat in the stream rendered
and encoded as ApplyChatTemplate does, its default max_new_tokens the room left."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from meshlm.common.default_model import ensure_default_model
from meshlm.common.errors import MeshError
from meshlm.tokenizer.server import TokenizerServicer
from meshlm.tokenizer.tokenization import TextTokenizer
from meshlm.tokenizer.workers import Workers
from meshlm.v1 import common_pb2, scheduler_pb2, tokenizer_pb2

BIG = 1000


class _Scheduler:
    def __init__(self) -> None:
        self.rids: list[str] = []
        self.items: dict[str, scheduler_pb2.TokenizedRequest] = {}
        self.arrived = asyncio.Event()

    async def put(self, items: list[scheduler_pb2.TokenizedRequest]) -> None:
        self.rids += [r.meta.rid for r in items]
        self.items.update((r.meta.rid, r) for r in items)
        self.arrived.set()


class _Schedulers:
    def __init__(self) -> None:
        self.one = _Scheduler()

    def get(self, address: str) -> _Scheduler:
        return self.one


class _GatedWorkers(Workers):
    """Big jobs wait for `release` before they start."""

    def __init__(self) -> None:
        super().__init__(big_chars=BIG)
        self.release = asyncio.Event()

    async def run(self, chars: int, fn: Callable[..., Any], *args: Any) -> Any:
        if self.is_big(chars):
            await self.release.wait()
        return await super().run(chars, fn, *args)


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_pretrained(ensure_default_model())


def _request(rid: str, text: str) -> tokenizer_pb2.GenerateRequest:
    return tokenizer_pb2.GenerateRequest(
        text=text, add_special_tokens=True, meta=common_pb2.RequestMeta(
            rid=rid, sampling=common_pb2.SamplingParams(max_new_tokens=4, logprob_start_len=-1),
            route=common_pb2.Route(scheduler="s:1")))


async def _batches(queue: asyncio.Queue[tokenizer_pb2.GenerateBatch | None]
                   ) -> AsyncIterator[tokenizer_pb2.GenerateBatch]:
    while (batch := await queue.get()) is not None:
        yield batch


def _servicer(tok: TextTokenizer, workers: Workers) -> tuple[TokenizerServicer, _Scheduler]:
    schedulers = _Schedulers()
    info = common_pb2.ModelInfo(model_path=str(tok.model_path), max_model_len=tok.max_model_len)
    servicer = TokenizerServicer(tok, schedulers, info, workers=workers)  # type: ignore[arg-type]
    return servicer, schedulers.one


async def test_small_requests_pass_a_big_one_on_the_same_stream(tok: TextTokenizer) -> None:
    workers = _GatedWorkers()
    servicer, scheduler = _servicer(tok, workers)
    queue: asyncio.Queue[tokenizer_pb2.GenerateBatch | None] = asyncio.Queue()
    replies = servicer.Submit(_batches(queue), None)  # type: ignore[arg-type]
    collected = asyncio.ensure_future(_collect(replies))
    try:
        words = "word " * (BIG // 5)  # big, and fits the context
        await queue.put(tokenizer_pb2.GenerateBatch(requests=[_request("big", words)]))
        await queue.put(tokenizer_pb2.GenerateBatch(requests=[_request("small", "hi there")]))
        await asyncio.wait_for(scheduler.arrived.wait(), 5)
        assert scheduler.rids == ["small"]  # the big one has not even started
        workers.release.set()
        await queue.put(None)
        assert await asyncio.wait_for(collected, 10) == []
        assert scheduler.rids == ["small", "big"]
    finally:
        workers.release.set()
        collected.cancel()
        workers.close()


async def test_a_prompt_that_cannot_fit_is_refused_the_others_go_on(tok: TextTokenizer) -> None:
    workers = Workers(big_chars=BIG)
    servicer, scheduler = _servicer(tok, workers)
    queue: asyncio.Queue[tokenizer_pb2.GenerateBatch | None] = asyncio.Queue()
    try:
        long = "many different words here " * 20_000  # 520 k characters, far over 2048 tokens
        await queue.put(tokenizer_pb2.GenerateBatch(requests=[
            _request("long", long), _request("short", "hello"), _request("medium", "hi " * 400)]))
        await queue.put(None)
        rejections = await asyncio.wait_for(
            _collect(servicer.Submit(_batches(queue), None)), 30)  # type: ignore[arg-type]
        [rejection] = rejections
        assert rejection.rid == "long"
        assert rejection.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert rejection.status.message.startswith("text: the prompt is more than")
        assert "context length (2048 tokens)" in rejection.status.message
        assert sorted(scheduler.rids) == ["medium", "short"]
    finally:
        workers.close()


async def test_apply_chat_template_can_leave_the_final_message_open(tok: TextTokenizer) -> None:
    workers = Workers(big_chars=BIG)
    servicer, _ = _servicer(tok, workers)
    messages = json.dumps([{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Once upon"}])
    try:
        reply = await servicer.ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(
            messages_json=messages, continue_final_message=True), None)  # type: ignore[arg-type]
        text = tok.decode(reply.tokens, skip_special_tokens=False)
        assert text.endswith("<|im_start|>assistant\nOnce upon")
        with pytest.raises(MeshError) as info:
            await servicer.ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(
                messages_json=messages, continue_final_message=True,
                add_generation_prompt=True), None)  # type: ignore[arg-type]
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.message.startswith("messages: continue_final_message")
        # The tokenizer checks a chat's template variables again, whoever sent them.
        for kwargs, start in (('{"messages": []}', "chat_template_kwargs.messages: is set"),
                              ("[1]", "chat_template_kwargs: must be an object"),
                              ("{", "chat_template_kwargs: not valid JSON")):
            with pytest.raises(MeshError) as info:
                await servicer.ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(
                    messages_json=messages, template_kwargs_json=kwargs),
                    None)  # type: ignore[arg-type]
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.message.startswith(start), info.value.message
    finally:
        workers.close()


def _chat(rid: str, messages: str, *, fill: bool, open_final: bool = False,
          max_new_tokens: int = 4, min_new_tokens: int = 0) -> tokenizer_pb2.GenerateRequest:
    return tokenizer_pb2.GenerateRequest(
        chat=tokenizer_pb2.ChatTemplateRequest(messages_json=messages, add_generation_prompt=True,
                                               continue_final_message=open_final),
        fill_max_new_tokens=fill, meta=common_pb2.RequestMeta(
            rid=rid, sampling=common_pb2.SamplingParams(
                max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                logprob_start_len=-1),
            route=common_pb2.Route(scheduler="s:1")))


async def test_a_chat_in_the_stream_is_rendered_and_encoded_there(tok: TextTokenizer) -> None:
    workers = Workers(big_chars=BIG)
    servicer, scheduler = _servicer(tok, workers)
    user = json.dumps([{"role": "user", "content": "Hi"}])
    queue: asyncio.Queue[tokenizer_pb2.GenerateBatch | None] = asyncio.Queue()
    try:
        await queue.put(tokenizer_pb2.GenerateBatch(requests=[
            _chat("room", user, fill=True), _chat("asked", user, fill=False),
            _chat("refused", user, fill=True, open_final=True),
            _chat("min over room", user, fill=True, min_new_tokens=tok.max_model_len)]))
        await queue.put(None)
        rejection, over = await asyncio.wait_for(
            _collect(servicer.Submit(_batches(queue), None)), 30)  # type: ignore[arg-type]
        rendered = await servicer.ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(
            messages_json=user, add_generation_prompt=True), None)  # type: ignore[arg-type]
        room, asked = scheduler.items["room"], scheduler.items["asked"]
        assert list(room.input_ids) == list(asked.input_ids) == list(rendered.tokens)
        assert room.meta.sampling.max_new_tokens == tok.max_model_len - len(rendered.tokens)
        assert asked.meta.sampling.max_new_tokens == 4  # the client's max_tokens stays
        assert rejection.rid == "refused"
        assert rejection.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert rejection.status.message.startswith("messages: continue_final_message")
        room = tok.max_model_len - len(rendered.tokens)
        assert over.rid == "min over room" and over.status.message == (
            f"sampling_params.min_new_tokens: must be in [0, max_new_tokens={room}], "
            f"got {tok.max_model_len}")
    finally:
        workers.close()


async def _collect(replies: AsyncIterator[tokenizer_pb2.RejectionBatch]
                   ) -> list[tokenizer_pb2.Rejection]:
    return [r for batch in [b async for b in replies] for r in batch.rejections]


async def test_a_prompt_cut_as_asked_fits_and_keeps_the_side_asked(tok: TextTokenizer) -> None:
    """truncate_prompt_tokens: a prompt far over the context is cut (not refused) before the
    context is checked, keeping its last ids, or its first with truncate_right; given ids are
    cut alike."""
    workers = Workers(big_chars=BIG)
    servicer, scheduler = _servicer(tok, workers)
    queue: asyncio.Queue[tokenizer_pb2.GenerateBatch | None] = asyncio.Queue()
    long = "many different words here " * 20_000
    whole = tok.encode("one two three four five six")
    last, first = _request("last", long), _request("first", "one two three four five six")
    last.truncate_prompt_tokens = first.truncate_prompt_tokens = 3
    first.truncate_right = True
    ids = tokenizer_pb2.GenerateRequest(
        input_ids=tokenizer_pb2.TokenIds(ids=[5, 6, 7, 8]), truncate_prompt_tokens=2,
        meta=common_pb2.RequestMeta(rid="ids", route=common_pb2.Route(scheduler="s:1"),
                                    sampling=common_pb2.SamplingParams(max_new_tokens=4,
                                                                       logprob_start_len=-1)))
    try:
        await queue.put(tokenizer_pb2.GenerateBatch(requests=[last, first, ids]))
        await queue.put(None)
        rejections = await asyncio.wait_for(
            _collect(servicer.Submit(_batches(queue), None)), 60)  # type: ignore[arg-type]
        assert rejections == []
        assert list(scheduler.items["last"].input_ids) == tok.encode(long)[-3:]
        assert list(scheduler.items["first"].input_ids) == whole[:3]
        assert list(scheduler.items["ids"].input_ids) == [7, 8]
    finally:
        workers.close()
