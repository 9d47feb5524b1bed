"""Packed batches on the internal hops (common.proto PackedOutputs): the scheduler's TokenBatch
and the detokenizer's TextBatch carry their common outputs, a running request's new ids, counts
and text, as parallel arrays, and only the rare ones (a request's first and last, logprobs,
errors, embeddings) as whole messages.

A step of n requests then costs a handful of array operations to encode and decode instead of n
messages (`python -m meshlm.bench.wire`: per output of a 64-output step, 0.26 us to build and
serialize against 0.96 as submessages, 0.31 against 0.50 to parse and read).

Senders queue items in order, each a whole message or a `Plain` tuple; `packer` turns a list of
them into one batch, and `unpack` gives a received batch's items back in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, pairwise, repeat
from typing import Any, TypeVar

import grpc

from meshlm.common.errors import MeshError
from meshlm.v1 import common_pb2

# A common output: (rid, new token ids, prompt tokens, completion tokens, cached tokens, new
# text); the text is "" on the scheduler's hop.
Plain = tuple[str, Sequence[int], int, int, int, str]

M = TypeVar("M")
B = TypeVar("B")


def packer(batch_type: Callable[..., B], *, texts: bool = False
           ) -> Callable[[list[Any]], B]:
    """`make_batch` for a BatchedStream of whole messages and Plain tuples: the messages go
    whole, in `outputs`, the tuples into `packed`, the order kept (`texts`: with each tuple's
    text)."""

    def make_batch(items: list[Any]) -> B:
        rids: list[str] = []
        counts: list[int] = []
        ids: list[int] = []
        prompt: list[int] = []
        completion: list[int] = []
        cached: list[int] = []
        text: list[str] = []
        whole: list[Any] = []
        at: list[int] = []
        for item in items:
            if isinstance(item, tuple):
                rid, new_ids, p, c, k, t = item
                rids.append(rid)
                counts.append(len(new_ids))
                ids.extend(new_ids)
                prompt.append(p)
                completion.append(c)
                cached.append(k)
                text.append(t)
            else:
                at.append(len(rids))
                whole.append(item)
        if not rids:
            return batch_type(outputs=whole)
        return batch_type(outputs=whole, packed=common_pb2.PackedOutputs(
            rids=rids, token_counts=counts, token_ids=ids, prompt_tokens=prompt,
            completion_tokens=completion, cached_tokens=cached, texts=text if texts else (),
            outputs_at=at))

    return make_batch


def unpack(outputs: Sequence[M], packed: common_pb2.PackedOutputs) -> list[M | Plain]:
    """A received batch's items in the order they were made: its whole `outputs` and its
    `packed` entries as Plain tuples. A batch whose arrays disagree is INVALID_ARGUMENT."""
    n = len(packed.rids)
    if not n:
        return list(outputs)
    ids, counts = packed.token_ids, packed.token_counts
    fewest, total = (min(counts), sum(counts)) if counts else (0, 0)
    if fewest < 0 or total != len(ids):
        raise _malformed("token_counts do not add up to the token_ids")
    if fewest == 1 and total == n:  # one new id each: the common step
        new_ids: Iterable[Sequence[int]] = ([i] for i in ids)
    else:
        new_ids = (ids[start:end] for start, end in pairwise(accumulate(counts, initial=0)))
    try:
        items: list[M | Plain] = list(zip(
            packed.rids, new_ids, packed.prompt_tokens, packed.completion_tokens,
            packed.cached_tokens, packed.texts or repeat("", n), strict=True))
    except ValueError:
        raise _malformed("its per-entry arrays differ in length from rids") from None
    at = packed.outputs_at
    if len(at) != len(outputs) or (outputs and (
            any(a > b for a, b in pairwise(at)) or at[0] < 0 or at[-1] > n)):
        raise _malformed("outputs_at does not place each whole output, in order, among the "
                         "entries")
    for k in range(len(outputs) - 1, -1, -1):  # whole outputs into their places, last first
        items.insert(at[k], outputs[k])
    return items


def _malformed(problem: str) -> MeshError:
    return MeshError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed packed outputs: {problem}")
