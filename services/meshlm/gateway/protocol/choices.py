"""n > 1 samples of one prompt ("choices"): the gateway fans a request out into n child requests
and folds their outputs back into what the client gets. Pure: no I/O.

Child i of request `rid` has rid f"{rid}-{i}" (n == 1: the request's own rid). Child 0 leads;
the others are sent `after` it, so the scheduler computes the prompt once and admits them on
its KV blocks (they go to the same scheduler, in one batch, leader first). A seeded request
gives child i seed + i: the n samples differ from each other, and the same request gives the
same n samples again.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.gateway.mesh.inbox import Update
from meshlm.v1 import common_pb2


@dataclass(frozen=True)
class Child:
    """One of a request's n child requests."""

    index: int
    rid: str
    after: str  # the leader's rid for followers; "" for the leader
    sampling: common_pb2.SamplingParams


def child_rids(rid: str, n: int) -> list[str]:
    """The rids of a request's children (also how an abort of `rid` finds them)."""
    return [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]


def fan_out(rid: str, n: int, sampling: common_pb2.SamplingParams) -> list[Child]:
    rids = child_rids(rid, n)
    children = []
    for i, child in enumerate(rids):
        params = sampling
        if i and sampling.HasField("seed"):
            params = common_pb2.SamplingParams()
            params.CopyFrom(sampling)
            params.seed = sampling.seed + i  # < 2**63 + 16: fits the uint64 field
        children.append(Child(index=i, rid=child, after=rids[0] if i else "", sampling=params))
    return children


class Choices:
    """Folds the children's updates into the messages a client gets, as (index, Update) pairs.

    Streaming: every update as it arrives, children interleaved. Not streaming: each child's
    updates merged into one final update, and all n given together, in index order, once the
    last child has finished. Errors are the caller's to handle (the whole request fails)."""

    def __init__(self, n: int, stream: bool) -> None:
        self.n = n
        self.stream = stream
        self.finals: list[Update | None] = [None] * n  # each child's finishing update
        self.done = False  # every child has finished (kept, not computed: read per update)
        self._running = n
        self._held: list[list[Update]] = [[] for _ in range(n)]

    def add(self, index: int, update: Update) -> list[tuple[int, Update]]:
        """Take child `index`'s update; returns what is due to the client now."""
        if update.final is not None:
            if self.finals[index] is None:
                self._running -= 1
                self.done = not self._running
            self.finals[index] = update
        if self.stream:
            return [(index, update)]
        self._held[index].append(update)
        if not self.done:
            return []
        due = [(i, merge_updates(held)) for i, held in enumerate(self._held)]
        self._held = [[] for _ in range(self.n)]
        return due

    def finish_reason(self) -> str:
        """The finish reasons of all children, comma-separated (for the registry record)."""
        return ",".join(f.final.finish_reason for f in self.finals
                        if f is not None and f.final is not None)


def merge_updates(updates: list[Update]) -> Update:
    """One update with the text, ids and logprobs of several, counts from the last, the
    prompt's ids from the first that has them."""
    last = updates[-1]
    logprobs = None
    for u in updates:
        if u.logprobs is not None:
            if logprobs is None:
                logprobs = common_pb2.Logprobs()
            logprobs.MergeFrom(u.logprobs)
    return Update(text="".join(u.text for u in updates),
                  token_ids=[t for u in updates for t in u.token_ids], final=last.final,
                  error=last.error, prompt_tokens=last.prompt_tokens,
                  completion_tokens=last.completion_tokens, cached_tokens=last.cached_tokens,
                  logprobs=logprobs, embedding=last.embedding,
                  prompt_ids=next((u.prompt_ids for u in updates if u.prompt_ids is not None),
                                  None))
