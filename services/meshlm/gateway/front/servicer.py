"""The public gRPC face: sglang.runtime.v1.SglangService, delegating every RPC to GatewayAPI.

RPCs the API does not implement yet keep the generated base class's UNIMPLEMENTED answer. A
call with a big request has its memory reclaimed soon after it ends (`front/reclaim.py`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from meshlm.common.deadline import set_deadline
from meshlm.common.errors import MeshError
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.generation import GatewayAPI
from meshlm.gateway.front.reclaim import Reclaimer
from sglang.runtime.v1 import sglang_pb2, sglang_pb2_grpc

SERVICE = sglang_pb2.DESCRIPTOR.services_by_name["SglangService"]


def call_context(context: grpc.aio.ServicerContext) -> CallContext:
    """The call's facts; its deadline also becomes the current one (`common/deadline.py`)."""
    metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())
                if isinstance(v, str)}
    remaining = context.time_remaining()
    deadline = time.time() + remaining if remaining is not None else None
    set_deadline(deadline)
    return CallContext(metadata=metadata, peer=context.peer() or "", deadline=deadline)


def _unary(name: str) -> Callable[..., Any]:
    async def method(self: SglangServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await getattr(self.api, name)(request, call_context(context))
        finally:
            self.reclaim.after(request.ByteSize())
    method.__name__ = name
    return method


def _stream(name: str) -> Callable[..., Any]:
    async def method(self: SglangServicer, request: Any,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in getattr(self.api, name)(request, call_context(context)):
                yield item
        finally:
            self.reclaim.after(request.ByteSize())
    method.__name__ = name
    return method


class SglangServicer(sglang_pb2_grpc.SglangServiceServicer):
    def __init__(self, api: GatewayAPI, reclaim: Reclaimer | None = None) -> None:
        self.api = api
        self.reclaim = reclaim or Reclaimer()


def _unimplemented(name: str) -> Callable[..., Any]:
    async def method(self: SglangServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise MeshError(grpc.StatusCode.UNIMPLEMENTED,
                        f"{SERVICE.full_name}/{name} is not implemented yet")
    method.__name__ = name
    return method


for _m in SERVICE.methods:
    if hasattr(GatewayAPI, _m.name):
        setattr(SglangServicer, _m.name,
                (_stream if _m.server_streaming else _unary)(_m.name))
    else:
        setattr(SglangServicer, _m.name, _unimplemented(_m.name))
