"""A tokenizer's Submit stream lost while the tokenizer still serves (its health is watched on
another connection, so nothing flips): the requests there without output end UNAVAILABLE, since
what the stream carried may be lost and nobody else would end them; those with output are past
the tokenizer and go on; no new request goes to that tokenizer until its stream is back."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from meshlm.bench.gateway_path import ADDRESS, StandInMesh, stand_in_api
from meshlm.common.errors import MeshError
from meshlm.common.rpc import CallContext
from meshlm.v1 import gateway_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

TOKENIZER = ADDRESS["tokenizer"]


async def _run(api: Any, rid: str) -> list[pb.TextGenerateResponse]:
    request = pb.TextGenerateRequest(text=f"prompt of {rid}", stream=True, rid=rid,
                                     sampling_params=pb.SamplingParams(max_new_tokens=5))
    return [m async for m in api.generation.TextGenerate(request, CallContext())]


async def _started(box: list[StandInMesh], count: int) -> None:
    while len(box[0].started) < count:
        await asyncio.sleep(0)


def _output(rid: str, token: int, finished: bool = False) -> gateway_pb2.TextOutput:
    return gateway_pb2.TextOutput(rid=rid, token_ids=[token], text=f" w{token}",
                                  prompt_tokens=3, completion_tokens=token + 1,
                                  finished=finished, finish_reason="length" if finished else "")


async def test_a_lost_submit_stream_ends_its_requests_without_output_and_is_not_picked():
    box: list[StandInMesh] = []
    api, table = stand_in_api(box)
    box.append(StandInMesh(table, 0))
    waiting = asyncio.create_task(_run(api, "waiting"))
    running = asyncio.create_task(_run(api, "running"))
    await _started(box, 2)
    table.requests["running"].deliver(_output("running", 0))
    for _ in range(5):
        await asyncio.sleep(0)

    submit = api.generation.submit[TOKENIZER]
    submit.lost = True  # as BatchedStream sets it before its on_lost
    api.generation.on_submit_lost(TOKENIZER)
    with pytest.raises(MeshError) as err:
        await asyncio.wait_for(waiting, 5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.message == f"the stream to the tokenizer at {TOKENIZER} was lost"

    # Its only tokenizer's stream is down: a new request is refused at once, not queued.
    with pytest.raises(MeshError) as err:
        await asyncio.wait_for(_run(api, "meanwhile"), 5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.message == "no tokenizer is available"

    # The request past the tokenizer finishes; once the stream is back, new ones go again.
    assert not running.done()
    table.requests["running"].deliver(_output("running", 1, finished=True))
    assert (await asyncio.wait_for(running, 5))[-1].finished
    submit.lost = False
    after = asyncio.create_task(_run(api, "after"))
    await _started(box, 3)
    table.requests["after"].deliver(_output("after", 0, finished=True))
    assert (await asyncio.wait_for(after, 5))[-1].finished
    await api.generation.core.background.close()  # the aborts sent for the ended request
