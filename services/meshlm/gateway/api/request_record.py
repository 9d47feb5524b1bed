"""One request's record in the RID registry, from its creation to its one final state.

The record says where the request runs (gateway, tokenizer, scheduler, detokenizer; and n when
it has n samples), so an Abort on any gateway finds it. A rid the client chose may clash with
one on another gateway and is checked before anything is sent; a fresh one cannot, and is
recorded off the request's path. Whatever ends the request (its last output, a failure, its
deadline, or the client going away), the record ends exactly once.
"""

from __future__ import annotations

import grpc

from meshlm.common.errors import MeshError
from meshlm.gateway.mesh.registry import RidRegistry
from meshlm.v1 import common_pb2


class RequestRecord:
    def __init__(self, registry: RidRegistry, rid: str, route: common_pb2.Route, tokenizer: str,
                 n: int) -> None:
        self.registry = registry
        self.rid = rid
        self.fields = {"gateway": route.gateway, "tokenizer": tokenizer,
                       "scheduler": route.scheduler, "detokenizer": route.detokenizer}
        if n > 1:
            self.fields["n"] = str(n)  # how an abort elsewhere finds the children
        self.opened = False  # the registry has (or will have) the record
        self.ended = False   # its final state is written

    async def open(self, client_rid: bool) -> None:
        """Create the record; ALREADY_EXISTS when the client's rid is taken."""
        if client_rid:
            if not await self.registry.create(self.rid, self.fields):
                raise MeshError(grpc.StatusCode.ALREADY_EXISTS,
                                f"rid: {self.rid!r} is already in use")
        else:
            self.registry.create_later(self.rid, self.fields)
        self.opened = True

    def running(self) -> None:
        self.registry.update(self.rid, state="running")

    def finished(self, reason: str, completion_tokens: int) -> None:
        """Its samples all ended, `reason` being theirs (comma-joined)."""
        state = "aborted" if "abort" in reason.split(",") else "finished"
        self.end(state, finish_reason=reason, completion_tokens=completion_tokens)

    def failed(self, reason: str) -> None:
        self.end("error", finish_reason=reason)

    def abandoned(self) -> bool:
        """The client went away before the end: aborted (True if this ended it)."""
        if not self.opened or self.ended:
            return False
        self.end("aborted", finish_reason="abort")
        return True

    def end(self, state: str, **fields: object) -> None:
        if not self.ended:
            self.ended = True
            self.registry.finish(self.rid, state, **fields)
