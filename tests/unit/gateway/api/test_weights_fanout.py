"""The gateway's UpdateWeightsFromDisk over fake scheduler channels: argument checks before any
call, one call per scheduler, refusals passed on with their code, partial failures named, and
the cached model info naming the new checkpoint."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from meshlm.common.errors import MeshError
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.weights import WeightsRPCs
from meshlm.v1 import common_pb2, scheduler_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

Reply = scheduler_pb2.UpdateWeightsResponse | grpc.StatusCode


class FakeChannels:
    """Each address's channel answers UpdateWeights with its reply (or that status code)."""

    def __init__(self, replies: dict[str, Reply]) -> None:
        self.replies = replies
        self.calls: list[tuple[str, scheduler_pb2.UpdateWeightsRequest]] = []

    def get(self, address: str) -> Any:
        method = self._method(address)

        def unused(*args: Any, **kwargs: Any) -> None:
            return None

        return SimpleNamespace(unary_unary=lambda *a, **kw: method, stream_unary=unused,
                               unary_stream=unused, stream_stream=unused)

    def _method(self, address: str) -> Any:
        async def call(request: scheduler_pb2.UpdateWeightsRequest, timeout: float) -> Any:
            self.calls.append((address, request))
            await asyncio.sleep(0)
            reply = self.replies[address]
            if isinstance(reply, grpc.StatusCode):
                raise grpc.aio.AioRpcError(reply, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details=f"{reply.name} from {address}")
            return reply

        return call


class Gateway(WeightsRPCs):
    """The weights RPCs over a core whose schedulers answer with `replies`."""

    def __init__(self, replies: dict[str, Reply]) -> None:
        self.channels = FakeChannels(replies)
        self.info = common_pb2.ModelInfo(
            model_path="/models/a", max_model_len=2048,
            json_info=json.dumps({"config": {"name": "a"}, "max_model_len": 2048}))
        super().__init__(SimpleNamespace(  # type: ignore[arg-type]
            deps=SimpleNamespace(addresses={"scheduler": list(replies)}),
            channels=self.channels, model=self.info))


def ok(path: str, retracted: int) -> scheduler_pb2.UpdateWeightsResponse:
    info = common_pb2.ModelInfo(model_path=path, json_info=json.dumps(
        {"config": {"name": "b"}, "device": "cpu"}))
    return scheduler_pb2.UpdateWeightsResponse(info=info, retracted=retracted, seconds=0.25,
                                               load_seconds=0.1)


async def _rpc(gw: Gateway, path: str, load_format: str | None = None) -> str:
    req = pb.UpdateWeightsRequest(model_path=path)
    if load_format is not None:
        req.load_format = load_format
    reply = await gw.UpdateWeightsFromDisk(req, CallContext())
    assert reply.success
    return str(reply.message)


async def test_every_scheduler_updates_and_model_info_names_the_new_checkpoint() -> None:
    gw = Gateway({"s0": ok("/models/b", 2), "s1": ok("/models/b", 1)})
    message = await _rpc(gw, "/models/b")
    assert message == ("Weights updated from /models/b (load_format auto) on 2 scheduler(s) in "
                       "0.25 s; 3 running request(s) retracted and recomputed.")
    assert [(a, r.model_path, r.load_format, r.abort_all) for a, r in gw.channels.calls] == [
        ("s0", "/models/b", "auto", False), ("s1", "/models/b", "auto", False)]
    assert gw.info is not None and gw.info.model_path == "/models/b"
    assert json.loads(gw.info.json_info) == {"config": {"name": "b"}, "max_model_len": 2048}
    update = await gw.update_weights("/models/b", "dummy", abort_all=True)
    assert gw.channels.calls[-1][1].abort_all and update.load_format == "dummy"


@pytest.mark.parametrize(("path", "load_format", "message"), [
    ("", None, "model_path: must not be empty"),
    ("models/b", None, "model_path: must be an absolute path, got 'models/b'"),
    ("/models/b", "gguf", "load_format: must be one of auto, safetensors, dummy; got 'gguf'"),
])
async def test_arguments_are_checked_before_any_call(path: str, load_format: str | None,
                                                     message: str) -> None:
    gw = Gateway({"s0": ok("/models/b", 0)})
    with pytest.raises(MeshError) as info:
        await _rpc(gw, path, load_format)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message == message and not gw.channels.calls


@pytest.mark.parametrize(("replies", "code", "says"), [
    ({"s0": grpc.StatusCode.FAILED_PRECONDITION, "s1": grpc.StatusCode.FAILED_PRECONDITION},
     grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION from s0"),
    ({"s0": grpc.StatusCode.NOT_FOUND}, grpc.StatusCode.NOT_FOUND, "NOT_FOUND from s0"),
    ({"s0": ok("/models/b", 0), "s1": grpc.StatusCode.FAILED_PRECONDITION},
     grpc.StatusCode.UNAVAILABLE, "failed on 1 of 2 replica(s) (s1: FAILED_PRECONDITION"),
    ({"s0": grpc.StatusCode.UNAVAILABLE, "s1": grpc.StatusCode.UNAVAILABLE},
     grpc.StatusCode.UNAVAILABLE, "failed on 2 of 2 replica(s)"),
])
async def test_refusals_keep_their_code_and_partial_failures_name_the_replicas(
    replies: dict[str, Reply], code: grpc.StatusCode, says: str,
) -> None:
    gw = Gateway(replies)
    with pytest.raises(MeshError) as info:
        await _rpc(gw, "/models/b")
    assert info.value.code == code and says in info.value.message, info.value.message
    assert gw.info is not None and gw.info.model_path == "/models/a"  # not updated
