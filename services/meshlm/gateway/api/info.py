"""HealthCheck, GetModelInfo, ListModels, GetLoad and GetServerInfo: what the gateway and the
mesh behind it are, and how loaded."""

from __future__ import annotations

import json

import grpc

from meshlm.common.errors import MeshError
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.core import GatewayCore
from meshlm.gateway.mesh.fanout import on_every
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb

LOAD_TIMEOUT = 10.0  # seconds


class InfoRPCs:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def HealthCheck(self, req: pb.HealthCheckRequest,
                          ctx: CallContext) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(healthy=self.core.is_healthy())

    async def GetModelInfo(self, req: pb.GetModelInfoRequest,
                           ctx: CallContext) -> pb.GetModelInfoResponse:
        await self.core.limits()
        model = await self.core.model_info()
        return pb.GetModelInfoResponse(model_path=model.model_path, json_info=model.json_info)

    def model_cards(self) -> list[pb.ModelCard]:
        model = self.core.model
        if model is None:
            return []
        return [pb.ModelCard(id=self.core.identity.served_model_name, root=model.model_path,
                             max_model_len=model.max_model_len)]

    async def ListModels(self, req: pb.ListModelsRequest,
                         ctx: CallContext) -> pb.ListModelsResponse:
        await self.core.limits()
        return pb.ListModelsResponse(models=self.model_cards())

    async def GetLoad(self, req: pb.GetLoadRequest, ctx: CallContext) -> pb.GetLoadResponse:
        """Every scheduler's load (`dp_rank`: one), its rank being its place in the list."""
        ranked = list(enumerate(self.core.deps.addresses["scheduler"]))
        if req.HasField("dp_rank"):
            if not 0 <= req.dp_rank < len(ranked):
                raise MeshError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank: must be in [0, {len(ranked)}), got {req.dp_rank}")
            ranked = [ranked[req.dp_rank]]
        replies = await on_every(
            self.core.channels, [a for _, a in ranked], lambda ch: scheduler_pb2_grpc.SchedulerStub(
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
        core = self.core
        info = {"gateway": core.identity.inbox,
                "served_model_name": core.identity.served_model_name,
                "dependencies": core.deps.status(), "registry_degraded": core.registry.degraded,
                "requests_in_flight": len(core.table.requests),
                "request_groups": len(core.table.groups),
                "max_model_len": core.model.max_model_len if core.model else None}
        return pb.GetServerInfoResponse(json_info=json.dumps(info))
