"""What every RPC family shares: the gateway's identity and bounds, its view of the mesh
(replicas, channels, the request table, the RID registry) and the model's facts, with the
lookups built on them (limits for validation, picking a replica, calling a tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from meshlm.common.channels import ChannelPool
from meshlm.common.errors import MeshError, invalid
from meshlm.common.logs import get_logger
from meshlm.common.tasks import BackgroundTasks
from meshlm.gateway.mesh.dependencies import Dependencies
from meshlm.gateway.mesh.inbox import RequestTable
from meshlm.gateway.mesh.registry import RidRegistry
from meshlm.gateway.protocol.bounds import Bounds
from meshlm.gateway.protocol.reasoning import tags
from meshlm.gateway.protocol.validation import Limits
from meshlm.v1 import common_pb2, scheduler_pb2_grpc, tokenizer_pb2_grpc

log = get_logger(__name__)

R = TypeVar("R")

CONTROL_TIMEOUT = 10.0  # seconds for internal unary calls


@dataclass
class GatewayIdentity:
    inbox: str  # this gateway's internal address (where detokenizers deliver)
    served_model_name: str
    tool_call_parser: str = ""  # the model's own tool-call format, for tool_choice "auto"
    reasoning_parser: str = ""  # how the model's thinking is marked ("": not read)
    trust_request_chat_template: bool = False  # a chat's own chat_template is rendered


def request_template(identity: GatewayIdentity, template: str) -> str:
    """A chat's own chat_template ("": none), if this gateway takes them; else a 400."""
    if template and not identity.trust_request_chat_template:
        raise invalid("chat_template", "this gateway renders only the model's own chat "
                                       "template (start it with --trust-request-chat-template "
                                       "to take the request's)")
    return template


class GatewayCore:
    def __init__(self, identity: GatewayIdentity, deps: Dependencies, table: RequestTable,
                 registry: RidRegistry, channels: ChannelPool,
                 bounds: Bounds | None = None) -> None:
        self.identity = identity
        self.deps = deps
        self.table = table
        self.registry = registry
        self.channels = channels
        self.bounds = bounds or Bounds()  # size bounds checked before any work
        self.model: common_pb2.ModelInfo | None = None  # from a tokenizer, once one answers
        self.engine_len: int | None = None  # the schedulers' context length, once one answered
        self.background = BackgroundTasks()  # work that outlives the call that began it

    async def refresh_info(self) -> None:
        """Fetch the model's facts from a tokenizer (limits for validation, model cards), and
        hold them to the engine's context length once a scheduler gave it."""
        address = self.deps.pick("tokenizer")
        if address is None:
            return
        stub = tokenizer_pb2_grpc.TokenizerStub(self.channels.get(address))
        try:
            self.model = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=CONTROL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            log.warning("model_info_failed", tokenizer=address, error=exc.details())
            return
        self.engine_len = None
        await self._engine_limit()

    async def _engine_limit(self) -> None:
        """The schedulers' context length (--max-model-len), from one that serves, in force
        when smaller than the checkpoint's: validation, Tokenize, GetModelInfo and the model
        cards all say it (so a request is refused rather than cut short)."""
        address = self.deps.pick("scheduler")
        if address is None or self.model is None:
            return
        stub = scheduler_pb2_grpc.SchedulerStub(self.channels.get(address))
        try:
            engine = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=CONTROL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            log.warning("engine_info_failed", scheduler=address, error=exc.details())
            return
        self.engine_len = engine.max_model_len
        if 0 < engine.max_model_len < self.model.max_model_len:
            log.info("context_length_from_engine", max_model_len=engine.max_model_len,
                     checkpoint=self.model.max_model_len, scheduler=address)
            self.model.max_model_len = engine.max_model_len
            facts = json.loads(self.model.json_info) if self.model.json_info else {}
            facts["max_model_len"] = engine.max_model_len
            self.model.json_info = json.dumps(facts)

    async def model_info(self) -> common_pb2.ModelInfo:
        """The model's facts; UNAVAILABLE until a tokenizer gave them."""
        if self.model is None:
            await self.refresh_info()
        if self.model is None:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "not ready: waiting for model info")
        return self.model

    async def limits(self) -> Limits:
        """What validation checks against; UNAVAILABLE until every role has a replica."""
        if self.model is None:
            await self.refresh_info()
        if self.model is None or not self.deps.ready:
            raise MeshError(grpc.StatusCode.UNAVAILABLE,
                            f"not ready: waiting for {self.missing() or 'model info'}")
        if self.engine_len is None:  # the facts came before any scheduler served
            await self._engine_limit()
        return self.limits_of(self.model)

    def limits_of(self, info: common_pb2.ModelInfo) -> Limits:
        parser = self.identity.reasoning_parser
        return Limits(max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                      max_prompt_chars=self.bounds.prompt_chars(info.max_model_len),
                      max_batch=self.bounds.batch,
                      thinking_tags=tags(parser) if parser else None)

    def is_healthy(self) -> bool:
        return self.deps.ready and self.model is not None

    def missing(self) -> str:
        """The roles with no SERVING replica, for log lines and UNAVAILABLE messages."""
        missing = [role for role in ("tokenizer", "scheduler", "detokenizer")
                   if not self.deps.serving(role)]
        return ", ".join(f"a serving {role}" for role in missing)

    def pick(self, role: str) -> str:
        address = self.deps.pick(role)
        if address is None:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, f"no {role} is available")
        return address

    def tokenizer(self) -> tokenizer_pb2_grpc.TokenizerStub:
        return tokenizer_pb2_grpc.TokenizerStub(self.channels.get(self.pick("tokenizer")))

    @staticmethod
    async def call(call: Awaitable[R]) -> R:
        """Await an internal call; its failure becomes the client's status."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise MeshError(grpc.StatusCode.UNAVAILABLE,
                                f"internal service: {exc.details()}") from exc
            raise MeshError(code, exc.details() or code.name) from exc
