"""The OpenAI routes and RPCs over a fake gateway: one implementation behind both (chunks and
their `finished` flags, SSE framing, [DONE]), a chat's messages sent in the request for the
tokenizer to render (a final message continued, echoed; no max_tokens: the room left),
token-id prompts echoed without special tokens, errors in OpenAI's JSON before the first chunk
and as an event after it, batches merged (one failure ends the rest), and the request ended
when the client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import orjson
import pytest

from meshlm.common.errors import MeshError
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.openai import OpenAIRPCs
from meshlm.gateway.api.scoring import ScoringRPCs
from meshlm.gateway.api.tokens import TokenRPCs
from meshlm.gateway.front.http_app import build_http_app
from meshlm.gateway.mesh.inbox import Update
from meshlm.gateway.protocol.validation import Limits, ValidatedRequest
from meshlm.v1 import gateway_pb2, tokenizer_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

LIMITS = Limits(max_model_len=64, vocab_size=100)
CHAT_TOKENS = [1, 2, 3]


def _update(text: str, *, done: str | None = None, completion: int = 1) -> Update:
    final = gateway_pb2.TextOutput(finished=True, finish_reason=done) if done else None
    return Update(text=text, token_ids=[5], final=final, error=None, prompt_tokens=3,
                  completion_tokens=completion, cached_tokens=0)


class FakeTokenizer:
    def __init__(self) -> None:
        self.requests: list[tokenizer_pb2.ChatTemplateRequest] = []

    async def ApplyChatTemplate(self, req: tokenizer_pb2.ChatTemplateRequest,
                                timeout: float) -> tokenizer_pb2.ChatTemplateResponse:
        self.requests.append(req)
        if "bad template" in req.messages_json:
            raise MeshError(grpc.StatusCode.INVALID_ARGUMENT, "messages: the template failed")
        return tokenizer_pb2.ChatTemplateResponse(tokens=CHAT_TOKENS)

    async def Detokenize(self, req: tokenizer_pb2.DetokenizeRequest,
                         timeout: float) -> tokenizer_pb2.DetokenizeResponse:
        """Token t reads "<t>"; token 0 is a special token."""
        kept = [t for t in req.tokens if t or not req.skip_special_tokens]
        return tokenizer_pb2.DetokenizeResponse(text="".join(f"<{t}>" for t in kept))


class FakeGateway(OpenAIRPCs):
    """Prompts pick a behaviour ("long": refused by the tokenizer; "late": fails after its
    first update; "hang": never finishes); any other prompt (chat: `mode`) gives each of its
    n samples "a" then "b" (streamed in two updates, the last sample first)."""

    def __init__(self) -> None:
        self.identity = SimpleNamespace(served_model_name="tiny", tool_call_parser="",
                                        reasoning_parser="")
        self.fake_tokenizer = FakeTokenizer()
        self.mode = "ok"
        self.validated: list[ValidatedRequest] = []
        self.ended: list[tuple[str, bool]] = []  # (prompt, ran to completion)
        # The OpenAI RPCs over this fake as their core and generation path; the routes'
        # api is this object too.
        tokens = TokenRPCs(self)  # type: ignore[arg-type]
        super().__init__(self, self, tokens)  # type: ignore[arg-type]
        self.openai = self
        self.scoring = ScoringRPCs(self, self, tokens)  # type: ignore[arg-type]

    async def limits(self) -> Limits:
        return LIMITS

    def tokenizer(self) -> FakeTokenizer:
        return self.fake_tokenizer

    @staticmethod
    async def call(call: Any) -> Any:
        return await call

    async def embed(self, v: ValidatedRequest) -> tuple[Update, dict[str, str]]:
        size = len(v.text) if v.text is not None else len(v.input_ids or [])
        update = Update(text="", token_ids=[], final=None, error=None, prompt_tokens=size,
                        completion_tokens=0, cached_tokens=0, embedding=[0.5, float(size)])
        return update, {"id": "e1", "prompt_tokens": str(size)}

    async def generate(self, v: ValidatedRequest, express: object = None
                       ) -> AsyncIterator[tuple[Update, dict[str, str]]]:
        self.validated.append(v)
        prompt = v.text if v.text is not None else self.mode
        completed = False
        try:
            if v.chat is not None and "bad template" in v.chat.messages_json:
                raise MeshError(grpc.StatusCode.INVALID_ARGUMENT,  # the tokenizer's refusal
                                "messages: the template failed")
            if prompt == "long":
                raise MeshError(grpc.StatusCode.INVALID_ARGUMENT,
                                "text: the prompt is 99 tokens, the model's context length is 64")
            rid = v.rid or "r1"

            def meta(i: int) -> dict[str, str]:
                return {"id": f"{rid}-{i}", "index": str(i)} if v.n > 1 else {"id": rid}

            if prompt in ("late", "hang"):
                yield _update("a"), meta(0)
                if prompt == "late":
                    raise MeshError(grpc.StatusCode.UNAVAILABLE, "the scheduler went away")
                await asyncio.Event().wait()
            if v.stream:
                for i in reversed(range(v.n)):
                    yield _update("a"), meta(i)
                for i in reversed(range(v.n)):
                    yield _update("b", done="stop", completion=2), meta(i)
            else:
                for i in range(v.n):
                    yield _update("ab", done="stop", completion=2), meta(i)
            completed = True
        finally:
            self.ended.append((prompt, completed))


@pytest.fixture
def gw() -> FakeGateway:
    return FakeGateway()


@pytest.fixture
async def client(gw: FakeGateway) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_http_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c


def _events(r: httpx.Response) -> list[Any]:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = r.content.split(b"\n\n")
    assert chunks[-1] == b"" and chunks[-2] == b"data: [DONE]"
    assert all(c.startswith(b"data: ") for c in chunks[:-1])
    return [orjson.loads(c[len(b"data: "):]) for c in chunks[:-2]]


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


USER = [{"role": "user", "content": "hi"}]


async def test_chat_reply_sends_the_messages_for_the_tokenizer_to_render(
        client: httpx.AsyncClient, gw: FakeGateway) -> None:
    r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["id"] == "chatcmpl-r1" and body["object"] == "chat.completion"
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "ab",
                                                        "reasoning_content": None},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["total_tokens"] == 5
    assert gw.fake_tokenizer.requests == []  # no round trip before the request goes
    [v] = gw.validated
    assert v.chat is not None and v.text is None and v.input_ids is None and v.return_text
    assert orjson.loads(v.chat.messages_json) == USER and v.chat.add_generation_prompt
    assert not v.chat.continue_final_message
    assert v.fill_max_new_tokens  # no max_tokens: the tokenizer fills in the room left
    r = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 7})
    assert not gw.validated[-1].fill_max_new_tokens
    assert gw.validated[-1].sampling.max_new_tokens == 7
    # min_tokens is held to the largest room a prompt can leave here, to the real one there
    r = await client.post("/v1/chat/completions", json={"messages": USER, "min_tokens": 50})
    assert r.status_code == 200 and gw.validated[-1].fill_max_new_tokens
    assert gw.validated[-1].sampling.max_new_tokens == LIMITS.max_model_len - 1


async def test_chat_stream(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json={
        "messages": USER, "stream": True, "n": 2, "stream_options": {"include_usage": True}})
    events = _events(r)
    assert {e["id"] for e in events} == {"chatcmpl-r1"}
    role = {"role": "assistant", "content": "", "reasoning_content": None}
    a, b = ({"content": t, "reasoning_content": None} for t in "ab")
    assert [(e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"])
            for e in events[:-1]] == [
        (1, role, None), (1, a, None), (0, role, None), (0, a, None),
        (1, b, "stop"), (0, b, "stop")]
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


async def test_chat_continues_and_echoes_the_final_message(client: httpx.AsyncClient,
                                                           gw: FakeGateway) -> None:
    opened = [*USER, {"role": "assistant", "content": "Once"}]
    r = await client.post("/v1/chat/completions", json={
        "messages": opened, "continue_final_message": True, "add_generation_prompt": False,
        "echo": True})
    assert r.json()["choices"][0]["message"]["content"] == "Onceab"
    [v] = gw.validated
    assert v.chat is not None
    assert v.chat.continue_final_message and not v.chat.add_generation_prompt
    events = _events(await client.post("/v1/chat/completions", json={
        "messages": opened, "continue_final_message": True, "echo": True, "stream": True}))
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == "Onceab"
    error = _error(await client.post("/v1/chat/completions", json={
        "messages": opened, "continue_final_message": True, "add_generation_prompt": True}),
        400)
    assert error["param"] == "continue_final_message"


async def test_completions_batch_reply_and_echo(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": ["x", [0, 7, 8]], "n": 2,
                                                   "echo": True})
    body = r.json()
    assert body["object"] == "text_completion"
    # Token ids are echoed as text without their special tokens (token 0 here).
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "xab"), (1, "xab"), (2, "<7><8>ab"), (3, "<7><8>ab")]


async def test_completions_stream(client: httpx.AsyncClient) -> None:
    events = _events(await client.post("/v1/completions", json={"prompt": "x",
                                                                "stream": True}))
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events] == [
        ("a", None), ("b", "stop")]
    assert all("usage" not in e for e in events)


@pytest.mark.parametrize(("path", "doc", "status", "param", "code"), [
    ("/v1/chat/completions", {"model": "gpt-4", "messages": USER}, 404, "model",
     "model_not_found"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/embeddings", {"model": "gpt-4", "input": "x"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": USER, "n": 0}, 400, "n", "invalid_argument"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "bad template"}]}, 400,
     "messages", "invalid_argument"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p", "invalid_argument"),
    ("/v1/completions", {"prompt": ["x", "long"]}, 400, "prompt[1]", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "long", "stream": True}, 400, "prompt",
     "context_length_exceeded"),
    ("/v1/embeddings", {"input": ["x", ""]}, 400, "input[1]", "invalid_argument"),
])
async def test_errors_before_the_first_chunk_are_openai_errors(
        client: httpx.AsyncClient, path: str, doc: dict[str, Any], status: int, param: str,
        code: str) -> None:
    error = _error(await client.post(path, json=doc), status)
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error" and error["message"].startswith(param)


async def test_bad_json_and_unexpected_failures(client: httpx.AsyncClient,
                                                gw: FakeGateway) -> None:
    error = _error(await client.post("/v1/completions", content=b"{"), 400)
    assert "not valid JSON" in error["message"]
    gw.identity = None  # type: ignore[assignment]  # a bug in the gateway
    error = _error(await client.post("/v1/completions", json={"prompt": "x"}), 500)
    assert error == {"message": "internal error", "type": "server_error", "param": None,
                     "code": "internal"}


async def test_a_failure_after_the_first_chunk_is_an_error_event(
        client: httpx.AsyncClient) -> None:
    events = _events(await client.post("/v1/completions", json={"prompt": "late",
                                                                "stream": True}))
    assert events[0]["choices"][0]["text"] == "a"
    assert events[-1] == {"error": {"message": "the scheduler went away", "type": "server_error",
                                    "param": None, "code": "unavailable"}}


async def test_one_failing_prompt_ends_the_others(client: httpx.AsyncClient,
                                                  gw: FakeGateway) -> None:
    error = _error(await client.post("/v1/completions", json={"prompt": ["hang", "late"]}), 503)
    assert error["message"] == "the scheduler went away"
    assert sorted(gw.ended) == [("hang", False), ("late", False)]


async def test_embeddings(client: httpx.AsyncClient, gw: FakeGateway) -> None:
    r = await client.post("/v1/embeddings", json={"input": ["abc", [1, 2]], "model": "tiny"})
    assert r.json() == {"object": "list", "model": "tiny", "data": [
        {"object": "embedding", "index": 0, "embedding": [0.5, 3.0]},
        {"object": "embedding", "index": 1, "embedding": [0.5, 2.0]}],
        "usage": {"prompt_tokens": 5, "total_tokens": 5}}
    reply = await gw.OpenAIEmbed(pb.OpenAIRequest(json_body=b'{"input": "abcd"}'), CallContext())
    assert reply.status_code == 200
    assert orjson.loads(reply.json_body)["data"][0]["embedding"] == [0.5, 4.0]


async def _rpc(gw: FakeGateway, rpc: str, doc: dict[str, Any]) -> list[pb.OpenAIStreamChunk]:
    stream = getattr(gw, rpc)(pb.OpenAIRequest(json_body=orjson.dumps(doc)), CallContext())
    return [chunk async for chunk in stream]


async def test_rpcs_stream_chunks_with_the_last_one_finished(gw: FakeGateway) -> None:
    [whole] = await _rpc(gw, "ChatComplete", {"messages": USER})
    assert whole.finished
    assert orjson.loads(whole.json_chunk)["choices"][0]["message"]["content"] == "ab"
    chunks = await _rpc(gw, "ChatComplete", {"messages": USER, "stream": True})
    assert [c.finished for c in chunks] == [False, False, True]
    assert orjson.loads(chunks[-1].json_chunk)["choices"][0]["finish_reason"] == "stop"
    chunks = await _rpc(gw, "Complete", {"prompt": "x", "stream": True,
                                         "stream_options": {"include_usage": True}})
    assert [c.finished for c in chunks] == [False, False, True]
    assert orjson.loads(chunks[-1].json_chunk)["usage"]["total_tokens"] == 5
    with pytest.raises(MeshError) as info:
        await _rpc(gw, "Complete", {"prompt": "x", "max_tokens": -1})
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith("max_tokens: ")


# ---- client disconnect -----------------------------------------------------------------------


async def _disconnect_after_first_chunk(gw: FakeGateway, path: str, doc: dict[str, Any]) -> None:
    """Drive the app over raw ASGI; the client leaves once a body chunk arrived (at once for a
    request that does not stream)."""
    app = build_http_app(gw)
    chunk_seen = asyncio.Event()
    if not doc.get("stream"):
        chunk_seen.set()
    inbox = [{"type": "http.request", "body": orjson.dumps(doc), "more_body": False}]

    async def receive() -> Any:
        if inbox:
            return inbox.pop(0)
        await chunk_seen.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunk_seen.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 5000), "server": ("gw", 80),
             "headers": [(b"content-type", b"application/json")]}
    await asyncio.wait_for(app(scope, receive, send), timeout=5)


@pytest.mark.parametrize(("path", "doc"), [
    ("/v1/completions", {"prompt": "hang", "stream": True}),
    ("/v1/completions", {"prompt": "hang"}),
    ("/v1/completions", {"prompt": ["hang", "x"], "stream": True}),
    ("/v1/chat/completions", {"messages": USER, "stream": True}),
])
async def test_client_disconnect_ends_the_request(gw: FakeGateway, path: str,
                                                  doc: dict[str, Any]) -> None:
    gw.mode = "hang"
    await _disconnect_after_first_chunk(gw, path, doc)
    assert ("hang", False) in gw.ended
