"""Requests this gateway owns, and the inbox that detokenizers stream their text into.

Each request has a mailbox that coalesces: outputs that arrive while the client is still
reading the previous ones are merged, never queued without bound and never blocking the
inbox. A slow client therefore costs only its own buffered text and stalls nobody else.
The n children of one request (n > 1) share one `ready` event, so one wait covers them all.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from meshlm.common.errors import MeshError
from meshlm.common.packed import Plain, unpack
from meshlm.common.server import Sink
from meshlm.v1 import common_pb2, gateway_pb2
from meshlm.v1 import gateway_pb2_grpc as pb_grpc


@dataclass(slots=True)
class Update:
    """Everything that arrived for one request since the client last read."""

    text: str
    token_ids: list[int]
    final: gateway_pb2.TextOutput | None  # the finishing output, if it arrived
    error: MeshError | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: common_pb2.Logprobs | None = None  # for token_ids (and the prompt, first)
    embedding: list[float] | None = None  # an embedding request's result
    prompt_ids: list[int] | None = None  # the prompt's ids (return_prompt_ids), first only


@dataclass
class PendingRequest:
    rid: str
    tokenizer: str
    scheduler: str
    detokenizer: str
    started_at: float
    _text: list[str] = field(default_factory=list)
    _ids: list[int] = field(default_factory=list)
    _final: gateway_pb2.TextOutput | None = None
    _error: MeshError | None = None
    _counts: tuple[int, int, int] = (0, 0, 0)
    _logprobs: common_pb2.Logprobs | None = None
    _embedding: list[float] | None = None
    _prompt_ids: list[int] | None = None
    _news: bool = False
    # Set on news; shared by the children of one request (see `next_updates`).
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    first_output: bool = False
    done: bool = False  # its final output or error was taken
    # Set while its handler waits with nothing taken: writes a running output to the client
    # itself, or declines (False) and the output is queued here (`api/direct.py`).
    direct: Callable[[Plain], bool] | None = None

    def deliver_running(self, item: Plain) -> None:
        """A running request's new text, ids and counts (the common output, packed)."""
        if self._final is not None or self._error is not None:
            return
        if self.direct is not None and not self._news and self.direct(item):
            return
        _, ids, prompt, completion, cached, text = item
        if text:
            self._text.append(text)
        self._ids.extend(ids)
        self._counts = (prompt, completion, cached)
        self._news = True
        self.ready.set()

    def deliver(self, out: gateway_pb2.TextOutput) -> None:
        """Any output, whole: its first, its last, with logprobs or an embedding."""
        if self._final is not None or self._error is not None:
            return
        if out.text:
            self._text.append(out.text)
        self._ids.extend(out.token_ids)
        if out.HasField("logprobs"):
            if self._logprobs is None:
                self._logprobs = common_pb2.Logprobs()
            self._logprobs.MergeFrom(out.logprobs)  # repeated fields append
        self._counts = (out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        if out.embedding:
            self._embedding = list(out.embedding)
        if out.prompt_ids:
            self._prompt_ids = list(out.prompt_ids)
        if out.finished:
            if out.finish_reason == "error":
                code = out.error.code or grpc.StatusCode.INTERNAL.value[0]
                self._error = MeshError.from_number(code, out.error.message or "request failed")
            else:
                self._final = out
        self._news = True
        self.ready.set()

    def fail(self, error: MeshError) -> None:
        if self._final is None and self._error is None:
            self._error = error
            self._news = True
            self.ready.set()

    def take(self) -> Update | None:
        """Everything that arrived since the last take, or None when nothing did."""
        if not self._news:
            return None
        self._news = False
        prompt, completion, cached = self._counts
        update = Update("".join(self._text), self._ids, self._final, self._error, prompt,
                        completion, cached, self._logprobs, self._embedding,
                        self._prompt_ids)  # positional: faster
        self._text, self._ids, self._logprobs, self._prompt_ids = [], [], None, None
        if update.final is not None or update.error is not None:
            self.done = True
        return update

    async def next(self) -> Update:
        """Wait for news, then take all of it."""
        [(_, update)] = await next_updates([self])
        return update


async def next_updates(requests: Sequence[PendingRequest]) -> list[tuple[int, Update]]:
    """Wait until any of `requests` (which share one `ready` event) has news; take it all, as
    (position in `requests`, update) pairs."""
    ready = requests[0].ready
    if len(requests) == 1:  # n == 1, the common case: no scan
        only = requests[0]
        while (update := only.take()) is None:
            ready.clear()
            await ready.wait()
        return [(0, update)]
    while True:
        news = [(i, u) for i, r in enumerate(requests) if (u := r.take()) is not None]
        if news:
            return news
        ready.clear()
        await ready.wait()


class RequestTable:
    """rid -> PendingRequest for every request this gateway owns."""

    def __init__(self) -> None:
        self.requests: dict[str, PendingRequest] = {}
        self.groups: dict[str, list[str]] = {}  # rid of an n > 1 request -> its children's
        self._per_scheduler: collections.Counter[str] = collections.Counter()

    def add(self, req: PendingRequest) -> None:
        self.add_group(req.rid, [req])

    def add_group(self, rid: str, children: list[PendingRequest]) -> None:
        """Add request `rid` as its child requests (n > 1; n == 1: the one child is `rid`
        itself), all or none."""
        names = {rid, *(c.rid for c in children)}
        if any(name in self.requests or name in self.groups for name in names):
            raise MeshError(grpc.StatusCode.ALREADY_EXISTS, f"rid: {rid!r} is already in use")
        for req in children:
            self.requests[req.rid] = req
            self._per_scheduler[req.scheduler] += 1
        if [c.rid for c in children] != [rid]:
            self.groups[rid] = [c.rid for c in children]

    def remove_group(self, rid: str) -> None:
        """Remove request `rid` and its children."""
        for child in self.groups.pop(rid, [rid]):
            self.remove(child)

    def members(self, rid: str) -> list[PendingRequest]:
        """The live requests `rid` names: its children (n > 1), or itself."""
        names = self.groups.get(rid, [rid])
        return [r for name in names if (r := self.requests.get(name)) is not None]

    def remove(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is not None:
            self._per_scheduler[req.scheduler] -= 1

    def get(self, rid: str) -> PendingRequest | None:
        return self.requests.get(rid)

    def fail(self, rid: str, error: MeshError) -> None:
        req = self.requests.get(rid)
        if req is not None:
            req.fail(error)

    def count_on(self, scheduler: str) -> int:
        """Requests of this gateway in flight on a scheduler (for least-loaded routing)."""
        return self._per_scheduler[scheduler]


class InboxServicer(pb_grpc.GatewayInboxServicer):
    """Detokenizers' streams land here: on the native server each batch is delivered where it
    arrives (`sinks`), without a task switch and a loop turn before it."""

    def __init__(self, table: RequestTable) -> None:
        self._table = table

    async def Deliver(self, request_iterator: AsyncIterator[gateway_pb2.TextBatch],
                      context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        async for batch in request_iterator:  # on the native server: none (`sinks`)
            self.deliver(batch)
        return common_pb2.Empty()

    def deliver(self, batch: gateway_pb2.TextBatch) -> None:
        """One detokenizer batch: each output into its request's mailbox (or written to its
        client, `api/direct.py`)."""
        requests = self._table.requests
        for item in unpack(batch.outputs, batch.packed):
            if isinstance(item, tuple):
                req = requests.get(item[0])
                if req is not None:
                    req.deliver_running(item)
            else:
                req = requests.get(item.rid)
                if req is not None:
                    req.deliver(item)

    def sinks(self) -> dict[str, Sink]:
        """Deliver's batches delivered as they arrive (on the native server)."""
        return {"Deliver": Sink(gateway_pb2.TextBatch, self.deliver)}
