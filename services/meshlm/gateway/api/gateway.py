"""The gateway's api: one object per RPC family, all given the same core. The gRPC servicer
names each RPC's method (`front/servicer.py`); HTTP transcoding finds it by the RPC's name
in the proto (`handler`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshlm.common.metrics import GatewayMetrics
from meshlm.common.profiling import Profiling
from meshlm.common.streams import BatchedStream
from meshlm.gateway.api.admin import AdminRPCs
from meshlm.gateway.api.core import GatewayCore
from meshlm.gateway.api.generation import GenerationRPCs
from meshlm.gateway.api.info import InfoRPCs
from meshlm.gateway.api.openai import OpenAIRPCs
from meshlm.gateway.api.pause import PauseRPCs
from meshlm.gateway.api.profile import ProfileRPCs
from meshlm.gateway.api.scoring import ScoringRPCs
from meshlm.gateway.api.tokens import TokenRPCs
from meshlm.gateway.api.weights import WeightsRPCs
from meshlm.v1 import tokenizer_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

RPC_NAMES = frozenset(m.name for m in pb.DESCRIPTOR.services_by_name["SglangService"].methods)


class GatewayAPI:
    def __init__(self, core: GatewayCore,
                 submit: dict[str, BatchedStream[tokenizer_pb2.GenerateRequest]],
                 metrics: GatewayMetrics | None = None) -> None:
        self.core = core
        self.metrics = metrics or GatewayMetrics(lambda: core.identity.served_model_name)
        self.profiling = Profiling("gateway")
        self.generation = GenerationRPCs(core, submit, self.metrics, self.profiling)
        self.tokens = TokenRPCs(core)
        self.info = InfoRPCs(core)
        self.admin = AdminRPCs(core)
        self.pause = PauseRPCs(core)
        self.profile = ProfileRPCs(core, self.profiling)
        self.weights = WeightsRPCs(core)
        self.openai = OpenAIRPCs(core, self.generation, self.tokens)
        self.scoring = ScoringRPCs(core, self.generation, self.tokens)
        self.families = (self.generation, self.tokens, self.info, self.admin, self.pause,
                         self.profile, self.weights, self.openai, self.scoring)

    def handler(self, rpc: str) -> Callable[..., Any] | None:
        """The method serving SglangService's `rpc`; None if no family has it."""
        if rpc not in RPC_NAMES:
            return None
        for family in self.families:
            method = getattr(family, rpc, None)
            if method is not None:
                return method  # type: ignore[no-any-return]
        return None
