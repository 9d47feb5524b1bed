"""Packed batches on the internal hops (common.proto PackedOutputs): the scheduler's TokenBatch
and the detokenizer's TextBatch carry their common outputs, a running request's new ids, counts
and text, as parallel arrays, and only the rare ones (a request's first and last, logprobs,
errors, embeddings) as whole messages.

A step of n requests then costs a handful of array operations to encode and decode instead of n
messages (`python -m meshlm.bench.wire`: per output of a 64-output step, 0.26 us to build and
serialize against 0.96 as submessages, 0.31 against 0.50 to parse and read).

Senders queue items in order, each a whole message, a `Plain` tuple or a `Run` (entries
already packed: the detokenizer passes a step's arrays on as they came, with the texts added);
`packer` turns a list of them into one batch, and `unpack` gives a received batch's items back
in the same order, a run's entries as Plain tuples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate, chain, pairwise, repeat
from typing import Any, TypeVar, cast

import grpc

from meshlm.common.errors import MeshError
from meshlm.v1 import common_pb2

# A common output: (rid, new token ids, prompt tokens, completion tokens, cached tokens, new
# text); the text is "" on the scheduler's hop.
Plain = tuple[str, Sequence[int], int, int, int, str]

# A run of entries already packed (its outputs_at empty): they go into a batch as they are.
Run = common_pb2.PackedOutputs

M = TypeVar("M")
B = TypeVar("B")


def packer(batch_type: Callable[..., B], *, texts: bool = False
           ) -> Callable[[list[Any]], B]:
    """`make_batch` for a BatchedStream of whole messages, Plain tuples and Runs: the messages
    go whole, in `outputs`, the tuples and runs into `packed`, the order kept (`texts`: with
    each tuple's text)."""

    def make_batch(items: list[Any]) -> B:
        if len(items) == 1 and type(items[0]) is Run:  # the detokenizer's step, passed on
            return batch_type(packed=items[0])
        batch: Any = batch_type()
        packed = batch.packed
        entries: list[Any] = []  # tuples not yet in `packed`
        for item in items:
            if isinstance(item, tuple):
                entries.append(item)
                continue
            if entries:
                _add(packed, entries, texts)
                entries = []
            if type(item) is Run:
                packed.MergeFrom(item)
            else:
                packed.outputs_at.append(len(packed.rids))
                batch.outputs.append(item)
        if entries:
            _add(packed, entries, texts)
        if not packed.rids:
            batch.ClearField("packed")
        return cast(B, batch)

    return make_batch


def _add(packed: common_pb2.PackedOutputs, entries: list[Plain], texts: bool) -> None:
    """Append Plain tuples to `packed`'s arrays, a column at a time."""
    rids, new_ids, prompt, completion, cached, text = zip(*entries, strict=True)
    packed.rids.extend(rids)
    packed.token_counts.extend(map(len, new_ids))
    packed.token_ids.extend(chain.from_iterable(new_ids))
    packed.prompt_tokens.extend(prompt)
    packed.completion_tokens.extend(completion)
    packed.cached_tokens.extend(cached)
    if texts:
        packed.texts.extend(text)


def entry_ids(outputs: Sequence[Any], packed: common_pb2.PackedOutputs) -> list[Sequence[int]]:
    """Each packed entry's new ids, once the batch is checked: its arrays agree and
    `outputs_at` places each of its whole `outputs`, in order, among the entries (a batch that
    fails is INVALID_ARGUMENT)."""
    n = len(packed.rids)
    ids, counts = packed.token_ids, packed.token_counts
    if not (len(counts) == len(packed.prompt_tokens) == len(packed.completion_tokens)
            == len(packed.cached_tokens) == n and len(packed.texts) in (0, n)):
        raise _malformed("its per-entry arrays differ in length from rids")
    fewest, total = (min(counts), sum(counts)) if counts else (0, 0)
    if fewest < 0 or total != len(ids):
        raise _malformed("token_counts do not add up to the token_ids")
    at = packed.outputs_at
    if len(at) != len(outputs) or (outputs and (
            any(a > b for a, b in pairwise(at)) or at[0] < 0 or at[-1] > n)):
        raise _malformed("outputs_at does not place each whole output, in order, among the "
                         "entries")
    if fewest == 1 and total == n:  # one new id each: the common step
        return [[i] for i in ids]
    return [ids[start:end] for start, end in pairwise(accumulate(counts, initial=0))]


def unpack(outputs: Sequence[M], packed: common_pb2.PackedOutputs) -> list[M | Plain]:
    """A received batch's items in the order they were made: its whole `outputs` and its
    `packed` entries as Plain tuples (checked as `entry_ids` checks them)."""
    n = len(packed.rids)
    if not n and not packed.outputs_at:
        return list(outputs)
    new_ids = entry_ids(outputs, packed)
    items: list[M | Plain] = list(zip(
        packed.rids, new_ids, packed.prompt_tokens, packed.completion_tokens,
        packed.cached_tokens, packed.texts or repeat("", n), strict=True))
    at = packed.outputs_at
    for k in range(len(outputs) - 1, -1, -1):  # whole outputs into their places, last first
        items.insert(at[k], outputs[k])
    return items


def _malformed(problem: str) -> MeshError:
    return MeshError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed packed outputs: {problem}")
