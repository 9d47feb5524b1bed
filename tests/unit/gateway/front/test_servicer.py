"""The public servicer names every RPC of sglang.runtime.v1.SglangService itself, each handing
the call to its family's method of the same name (the one HTTP transcoding finds) with the
call's facts."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace
from typing import Any

from meshlm.common.rpc import CallContext
from meshlm.gateway.api.gateway import GatewayAPI
from meshlm.gateway.front.servicer import SglangServicer
from sglang.runtime.v1 import sglang_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["SglangService"]


def test_every_rpc_is_written_out_in_the_servicer() -> None:
    missing = [m.name for m in SERVICE.methods if m.name not in vars(SglangServicer)]
    assert not missing
    api = GatewayAPI(SimpleNamespace(channels=None, deps=None,  # type: ignore[arg-type]
                                     identity=SimpleNamespace(served_model_name="m")), {})
    for m in SERVICE.methods:
        method = vars(SglangServicer)[m.name]
        streaming = inspect.isasyncgenfunction(method)
        assert streaming == m.server_streaming, m.name
        # One line names the family's method; HTTP transcoding finds the same one.
        [(family, rpc)] = re.findall(r"self\.api\.(\w+)\.(\w+), req, ctx\)",
                                     inspect.getsource(method))
        assert rpc == m.name
        assert getattr(api, family).__getattribute__(rpc) == api.handler(m.name), m.name


class Context:
    """What grpc.aio hands a servicer, as far as the servicer reads it."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("X-Client", "test"), ("bin-bin", b"\x00"))  # type: ignore[return-value]

    def time_remaining(self) -> float | None:
        return 30.0

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5"


class Api:
    """Records what each RPC of the api layer was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, CallContext]] = []

    async def GetModelInfo(self, req: Any, ctx: CallContext) -> pb.GetModelInfoResponse:
        self.calls.append(("GetModelInfo", req, ctx))
        return pb.GetModelInfoResponse(model_path="m")

    async def TextGenerate(self, req: Any, ctx: CallContext):  # type: ignore[no-untyped-def]
        self.calls.append(("TextGenerate", req, ctx))
        for text in ("a", "b"):
            yield pb.TextGenerateResponse(text=text)


async def test_calls_reach_the_api_with_their_metadata_peer_and_deadline() -> None:
    api = Api()
    servicer = SglangServicer(SimpleNamespace(info=api, generation=api))  # type: ignore[arg-type]
    reply = await servicer.GetModelInfo(pb.GetModelInfoRequest(), Context())  # type: ignore[arg-type]
    assert reply.model_path == "m"
    texts = [r.text async for r in servicer.TextGenerate(pb.TextGenerateRequest(text="hi"),
                                                          Context())]  # type: ignore[arg-type]
    assert texts == ["a", "b"]
    (name1, _, ctx1), (name2, req2, ctx2) = api.calls
    assert (name1, name2) == ("GetModelInfo", "TextGenerate") and req2.text == "hi"
    assert ctx1.metadata == {"x-client": "test"} and ctx1.peer == "ipv4:127.0.0.1:5"
    assert ctx2.deadline is not None and ctx2.deadline > 0
