"""HealthCheck, GetModelInfo, ListModels, GetLoad and GetServerInfo: what the gateway and the
mesh behind it are, and how loaded."""

from __future__ import annotations

import json
from typing import Any

import grpc

from meshlm.common.rpc import CallContext
from meshlm.gateway.api.core import GatewayCore
from meshlm.gateway.mesh.fanout import on_every
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb

# Seconds a scheduler has to answer GetLoad for GetLoad / GetServerInfo. One that cannot (hung,
# or unreachable while its channel reconnects) is reported with its error, and the answer
# comes in time for a client's own deadline (often 10 s), instead of holding it.
LOAD_TIMEOUT = 3.0


class InfoRPCs:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def HealthCheck(self, req: pb.HealthCheckRequest,
                          ctx: CallContext) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(healthy=self.core.is_healthy())

    async def GetModelInfo(self, req: pb.GetModelInfoRequest,
                           ctx: CallContext) -> pb.GetModelInfoResponse:
        """The checkpoint: its path and, in json_info, the tokenizer's facts (config.json,
        max_model_len, ...) with SGLang's keys (model_path, tokenizer_path, is_generation,
        weight_version, model_type, architectures)."""
        await self.core.limits()
        model = await self.core.model_info()
        facts = json.loads(model.json_info) if model.json_info else {}
        config = facts.get("config") or {}
        facts.update(model_path=model.model_path, tokenizer_path=model.model_path,
                     is_generation=is_generation(config), weight_version="default",
                     model_type=config.get("model_type"),
                     architectures=config.get("architectures"))
        return pb.GetModelInfoResponse(model_path=model.model_path, json_info=json.dumps(facts))

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
        """Every scheduler's load, its rank being its place in the list; `dp_rank`: that one
        (none past the replicas, as SGLang answers)."""
        rank = req.dp_rank if req.HasField("dp_rank") else None
        return pb.GetLoadResponse(json_info=json.dumps(await self.loads(rank)))

    async def GetServerInfo(self, req: pb.GetServerInfoRequest,
                            ctx: CallContext) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(json_info=json.dumps(self.server_facts(
            await self.loads(None))))

    def server_facts(self, loads: list[dict[str, Any]]) -> dict[str, Any]:
        """The gateway's facts, and SGLang's max_total_num_tokens: the KV cache's tokens of
        the first scheduler in `loads` that answered (null if none did)."""
        core = self.core
        capacity = next((load["kv_blocks_total"] * load["kv_block_size"]
                         for load in loads if "kv_blocks_total" in load), None)
        return {"gateway": core.identity.inbox,
                "served_model_name": core.identity.served_model_name,
                "dependencies": core.deps.status(), "registry_degraded": core.registry.degraded,
                "requests_in_flight": len(core.table.requests),
                "request_groups": len(core.table.groups),
                "max_model_len": core.model.max_model_len if core.model else None,
                "max_total_num_tokens": capacity}

    async def loads(self, dp_rank: int | None) -> list[dict[str, Any]]:
        """Each scheduler's Engine.stats() with its dp_rank and address (or the error it
        answered), in rank order; `dp_rank`: only that one."""
        ranked = list(enumerate(self.core.deps.addresses["scheduler"]))
        if dp_rank is not None:
            ranked = [(rank, address) for rank, address in ranked if rank == dp_rank]
        replies = await on_every(
            self.core.channels, [a for _, a in ranked], lambda ch: scheduler_pb2_grpc.SchedulerStub(
                ch).GetLoad(scheduler_pb2.GetLoadRequest(), timeout=LOAD_TIMEOUT))
        loads: list[dict[str, Any]] = []
        for (rank, address), reply in zip(ranked, replies, strict=True):
            if isinstance(reply, grpc.aio.AioRpcError):
                loads.append({"dp_rank": rank, "address": address, "error": reply.details()})
            else:
                loads.append({"dp_rank": rank, **json.loads(reply.json_info),
                              "address": address})
        return loads


def is_generation(config: dict[str, Any]) -> bool:
    """Whether the checkpoint generates: a bare `*Model` architecture only embeds."""
    architectures = config.get("architectures") or [""]
    return not str(architectures[0]).endswith("Model")
