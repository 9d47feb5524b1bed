"""Direct writes (`api/direct.py`): while a streamed request's handler waits, the inbox writes
its running outputs to the client itself. The client gets the same messages as through the
handler; a message the transport cannot take at once goes through the mailbox instead, merged
with what follows it, and in order."""

from __future__ import annotations

import asyncio
from typing import Any

from meshlm.bench.gateway_path import StandInMesh, stand_in_api
from meshlm.common.rpc import CallContext
from meshlm.v1 import gateway_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

PROMPT = 17


class Client:
    """A TextGenerate call's messages in the order the client got them, by either path."""

    def __init__(self, accept: bool = True) -> None:
        self.messages: list[tuple[str, Any]] = []  # ("direct" | "handler", message)
        self.accept = accept  # whether the transport takes a message at once
        self.offered = 0

    def write_now(self, message: bytes) -> bool:  # as the native server's, given bytes
        self.offered += 1
        if self.accept:
            self.messages.append(("direct", pb.TextGenerateResponse.FromString(message)))
        return self.accept

    def fields(self) -> list[tuple[str, list[int], dict[str, str], bool]]:
        return [(m.text, list(m.output_ids),
                 {k: v for k, v in m.meta_info.items() if k != "e2e_latency"}, m.finished)
                for _, m in self.messages]


async def _start(client: Client, direct: bool, n: int = 1,
                 **fields: Any) -> tuple[Any, asyncio.Task, str]:
    box: list[StandInMesh] = []
    api, table = stand_in_api(box)
    box.append(StandInMesh(table, 0))
    request = pb.TextGenerateRequest(text="a prompt", stream=True, rid="r1", **fields,
                                     sampling_params=pb.SamplingParams(max_new_tokens=100, n=n))
    context = CallContext(write_now=client.write_now if direct else None)

    async def run() -> None:
        async for message in api.generation.TextGenerate(request, context):
            client.messages.append(("handler", message))
    task = asyncio.create_task(run())
    while not box[0].started:
        await asyncio.sleep(0)
    rid = box[0].started[0]
    return table.requests[rid], task, rid


def _running(rid: str, token: int) -> tuple[Any, ...]:
    return (rid, [token], PROMPT, token + 1, 0, f" w{token}")


async def _settle() -> None:
    for _ in range(5):  # the handler's task: woken, through its generators, waiting again
        await asyncio.sleep(0)


async def _stream(client: Client, direct: bool, tokens: int = 6) -> list[str]:
    req, task, rid = await _start(client, direct)
    req.deliver(gateway_pb2.TextOutput(rid=rid, token_ids=[0], text=" w0", prompt_tokens=PROMPT,
                                       completion_tokens=1))
    await _settle()
    for token in range(1, tokens - 1):
        req.deliver_running(_running(rid, token))
        await _settle()
    req.deliver(gateway_pb2.TextOutput(rid=rid, token_ids=[tokens - 1], text=" end",
                                       prompt_tokens=PROMPT, completion_tokens=tokens,
                                       finished=True, finish_reason="length"))
    await asyncio.wait_for(task, 5)
    return [path for path, _ in client.messages]


async def test_the_client_gets_the_same_messages_by_either_path() -> None:
    through_handler, direct = Client(), Client()
    assert await _stream(through_handler, direct=False) == ["handler"] * 6
    assert await _stream(direct, direct=True) == ["handler", *["direct"] * 4, "handler"]
    assert direct.fields() == through_handler.fields()
    assert direct.fields()[2] == (" w2", [2], {"id": "r1", "prompt_tokens": "17",
                                               "completion_tokens": "3", "cached_tokens": "0"},
                                  False)


async def test_what_the_transport_declines_is_merged_and_sent_in_order() -> None:
    client = Client()
    req, task, rid = await _start(client, direct=True)
    req.deliver(gateway_pb2.TextOutput(rid=rid, token_ids=[0], text=" w0", prompt_tokens=PROMPT,
                                       completion_tokens=1))
    await _settle()
    req.deliver_running(_running(rid, 1))
    client.accept = False  # the client's window is spent
    for token in (2, 3, 4):  # in one engine step's batch, before the handler runs
        req.deliver_running(_running(rid, token))
    assert client.offered == 2, "once one output waits in the mailbox, the rest queue behind it"
    client.accept = True
    await _settle()  # the handler sends what queued, merged, then waits again
    req.deliver_running(_running(rid, 5))
    req.deliver(gateway_pb2.TextOutput(rid=rid, token_ids=[6], text=" end", prompt_tokens=PROMPT,
                                       completion_tokens=7, finished=True,
                                       finish_reason="length"))
    await asyncio.wait_for(task, 5)
    paths = [path for path, _ in client.messages]
    assert paths == ["handler", "direct", "handler", "direct", "handler"]
    texts = [(text, ids, meta["completion_tokens"]) for text, ids, meta, _ in client.fields()]
    assert texts == [(" w0", [0], "1"), (" w1", [1], "2"), (" w2 w3 w4", [2, 3, 4], "5"),
                     (" w5", [5], "6"), (" end", [6], "7")]


async def test_logprobs_and_several_samples_always_take_the_handler() -> None:
    for fields in ({"n": 2}, {"return_logprob": True}):
        client = Client()
        req, task, rid = await _start(client, True, **fields)
        req.deliver(gateway_pb2.TextOutput(rid=rid, token_ids=[0], text=" w0",
                                           prompt_tokens=PROMPT, completion_tokens=1))
        await _settle()
        assert client.messages and req.direct is None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_failing_direct_write_leaves_the_request_to_its_handler() -> None:
    class Failing(Client):
        def write_now(self, message: bytes) -> bool:
            self.offered += 1
            raise RuntimeError("a bug in a direct write")

    client = Failing()
    assert await _stream(client, direct=True, tokens=6) == ["handler"] * 6
    assert client.offered == 1  # tried once, then this request's outputs went the usual way
    assert [text for text, _, _, _ in client.fields()] == [" w0", " w1", " w2", " w3", " w4",
                                                           " end"]
