"""Where a replica joins and leaves this gateway, in one place: its health watcher
(`Dependencies`), its channel, and for a tokenizer the Submit stream that requests go out on
(kept in the dict that `GatewayAPI.submit` is, so the API sees streams come and go)."""

from __future__ import annotations

from typing import Protocol

from meshlm.common.channels import ChannelPool, MessageTooLarge
from meshlm.common.streams import BatchedStream
from meshlm.gateway.mesh.dependencies import Dependencies
from meshlm.v1 import tokenizer_pb2, tokenizer_pb2_grpc

SubmitStreams = dict[str, BatchedStream[tokenizer_pb2.GenerateRequest]]
# A request put on a Submit stream this long after the one before is written at once (a lone
# request does not wait for the sender's turn); closer ones are gathered, a message a turn.
SUBMIT_QUIET = 0.002  # seconds


class SubmitOwner(Protocol):
    """Who owns the requests a Submit stream carries (`api/generation.py`)."""

    def on_rejections(self, batch: tokenizer_pb2.RejectionBatch, address: str) -> None:
        """The tokenizer at `address` refused some, or lost its stream to a scheduler."""

    def on_submit_lost(self, address: str) -> None:
        """The stream to the tokenizer at `address` failed: what it carried may be lost."""

    def on_too_large(self, request: tokenizer_pb2.GenerateRequest,
                     error: MessageTooLarge) -> None:
        """A request over the mesh's message limit was not sent."""


class Replicas:
    def __init__(self, deps: Dependencies, channels: ChannelPool, submit: SubmitStreams,
                 owner: SubmitOwner) -> None:
        self.deps = deps
        self._channels = channels
        self._submit = submit
        self._owner = owner

    def open_submit(self, address: str) -> None:
        """Start the gateway->tokenizer Submit stream to `address` (its channel must carry its
        server name already: `ChannelPool.get(address, name)`)."""
        channel = self._channels.stream_channel(address)
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        stream: BatchedStream[tokenizer_pb2.GenerateRequest] = BatchedStream(
            "gateway->tokenizer", address, stub.Submit,
            lambda items: tokenizer_pb2.GenerateBatch(requests=items),
            on_reply=lambda batch: self._owner.on_rejections(batch, address),
            ready=channel.channel_ready,
            on_lost=self._owner.on_submit_lost, on_too_large=self._owner.on_too_large,
            write_through=True, quiet=SUBMIT_QUIET)
        stream.start()
        self._submit[address] = stream

    def discovered(self, role: str) -> list[str]:
        return self.deps.discovered(role)

    async def add(self, role: str, address: str, server_name: str | None) -> None:
        """A discovered replica joins. A tokenizer gets its stream before it can be picked."""
        if not self.deps.add(role, address, server_name):  # also names its channel
            return
        if role == "tokenizer" and address not in self._submit:
            self.open_submit(address)  # before its health watch can report it SERVING

    async def remove(self, role: str, address: str) -> None:
        """A discovered replica leaves: its requests end UNAVAILABLE (`Dependencies.remove`),
        then its stream and channel close."""
        if not self.deps.remove(role, address):
            return
        stream = self._submit.pop(address, None) if role == "tokenizer" else None
        if stream is not None:
            await stream.close()
        await self._channels.discard(address)

    async def close(self) -> None:
        for stream in list(self._submit.values()):
            await stream.close()
