"""HealthCheck, GetModelInfo, ListModels, GetLoad and GetServerInfo, mixed into GatewayAPI."""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc

from meshlm.common.channels import ChannelPool
from meshlm.common.errors import MeshError
from meshlm.common.rpc import CallContext
from meshlm.gateway.mesh.dependencies import Dependencies
from meshlm.gateway.mesh.fanout import on_every
from meshlm.gateway.mesh.inbox import RequestTable
from meshlm.gateway.mesh.registry import RidRegistry
from meshlm.gateway.protocol.validation import Limits
from meshlm.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb

LOAD_TIMEOUT = 10.0  # seconds


@dataclass
class GatewayIdentity:
    inbox: str  # this gateway's internal address (where detokenizers deliver)
    served_model_name: str


class InfoRPCs:
    deps: Dependencies
    channels: ChannelPool
    table: RequestTable
    registry: RidRegistry
    info: common_pb2.ModelInfo | None
    identity: GatewayIdentity

    def is_healthy(self) -> bool:
        return self.deps.ready and self.info is not None

    async def _limits(self) -> Limits:
        raise NotImplementedError  # GatewayAPI's

    async def HealthCheck(self, req: pb.HealthCheckRequest,
                          ctx: CallContext) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(healthy=self.is_healthy())

    async def GetModelInfo(self, req: pb.GetModelInfoRequest,
                           ctx: CallContext) -> pb.GetModelInfoResponse:
        await self._limits()
        assert self.info is not None
        return pb.GetModelInfoResponse(model_path=self.info.model_path,
                                       json_info=self.info.json_info)

    def model_cards(self) -> list[pb.ModelCard]:
        if self.info is None:
            return []
        return [pb.ModelCard(id=self.identity.served_model_name, root=self.info.model_path,
                             max_model_len=self.info.max_model_len)]

    async def ListModels(self, req: pb.ListModelsRequest,
                         ctx: CallContext) -> pb.ListModelsResponse:
        await self._limits()
        return pb.ListModelsResponse(models=self.model_cards())

    async def GetLoad(self, req: pb.GetLoadRequest, ctx: CallContext) -> pb.GetLoadResponse:
        """Every scheduler's load (`dp_rank`: one), its rank being its place in the list."""
        ranked = list(enumerate(self.deps.addresses["scheduler"]))
        if req.HasField("dp_rank"):
            if not 0 <= req.dp_rank < len(ranked):
                raise MeshError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank: must be in [0, {len(ranked)}), got {req.dp_rank}")
            ranked = [ranked[req.dp_rank]]
        replies = await on_every(
            self.channels, [a for _, a in ranked], lambda ch: scheduler_pb2_grpc.SchedulerStub(
                ch).GetLoad(scheduler_pb2.GetLoadRequest(), timeout=LOAD_TIMEOUT))
        loads = []
        for (rank, address), reply in zip(ranked, replies, strict=True):
            if isinstance(reply, grpc.aio.AioRpcError):
                loads.append({"dp_rank": rank, "address": address, "error": reply.details()})
            else:
                loads.append({"dp_rank": rank, **json.loads(reply.json_info),
                              "address": address})
        return pb.GetLoadResponse(json_info=json.dumps(loads))

    async def GetServerInfo(self, req: pb.GetServerInfoRequest,
                            ctx: CallContext) -> pb.GetServerInfoResponse:
        info = {"gateway": self.identity.inbox,
                "served_model_name": self.identity.served_model_name,
                "dependencies": self.deps.status(), "registry_degraded": self.registry.degraded,
                "requests_in_flight": len(self.table.requests),
                "request_groups": len(self.table.groups),
                "max_model_len": self.info.max_model_len if self.info else None}
        return pb.GetServerInfoResponse(json_info=json.dumps(info))
