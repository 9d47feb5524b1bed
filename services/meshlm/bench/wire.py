"""The internal batches' encodings side by side: `python -m meshlm.bench.wire`.

One engine step's outputs to one detokenizer (and the detokenizer's to one gateway), a running
request's new id, counts and text each, sent as a submessage per request or packed
(common/packed.py): microseconds per output to build and serialize the batch, and to parse it
and read every output's fields, at a few batch sizes. Single-threaded, no I/O: it prices the
encoding the scheduler's and the detokenizer's event loops pay on every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click

from meshlm.common.packed import Plain, packer, unpack
from meshlm.v1 import detokenizer_pb2, gateway_pb2


def _items(n: int) -> list[Plain]:
    return [(f"{i:032x}", [1000 + i], 40 + i, 17, 0, " word") for i in range(n)]


def _per_request(items: list[Plain]) -> bytes:
    return detokenizer_pb2.TokenBatch(outputs=[detokenizer_pb2.TokenOutput(
        rid=rid, token_ids=ids, prompt_tokens=p, completion_tokens=c, cached_tokens=k)
        for rid, ids, p, c, k, _ in items]).SerializeToString()


def _read_per_request(raw: bytes) -> int:
    total = 0
    for out in detokenizer_pb2.TokenBatch.FromString(raw).outputs:
        if out.HasField("header") or out.finished:
            continue
        total += len(out.rid) + len(out.token_ids) + out.prompt_tokens + out.completion_tokens \
            + out.cached_tokens
    return total


_make_batch = packer(detokenizer_pb2.TokenBatch)


def _packed(items: list[Plain]) -> bytes:
    return _make_batch(list(items)).SerializeToString()


def _read_packed(raw: bytes) -> int:
    batch = detokenizer_pb2.TokenBatch.FromString(raw)
    total = 0
    for item in unpack(batch.outputs, batch.packed):
        if isinstance(item, tuple):
            rid, ids, p, c, k, _ = item
            total += len(rid) + len(ids) + p + c + k
    return total


def _text_per_request(items: list[Plain]) -> bytes:
    return gateway_pb2.TextBatch(outputs=[gateway_pb2.TextOutput(
        rid=rid, text=t, token_ids=ids, prompt_tokens=p, completion_tokens=c, cached_tokens=k)
        for rid, ids, p, c, k, t in items]).SerializeToString()


_make_text_batch = packer(gateway_pb2.TextBatch, texts=True)


def _text_packed(items: list[Plain]) -> bytes:
    return _make_text_batch(list(items)).SerializeToString()


def _read_per_request_text(raw: bytes) -> int:
    total = 0
    for out in gateway_pb2.TextBatch.FromString(raw).outputs:
        total += len(out.rid) + len(out.text) + len(out.token_ids) + out.completion_tokens
    return total


def _read_packed_text(raw: bytes) -> int:
    batch = gateway_pb2.TextBatch.FromString(raw)
    total = 0
    for item in unpack(batch.outputs, batch.packed):
        if isinstance(item, tuple):
            total += len(item[0]) + len(item[5]) + len(item[1]) + item[3]
    return total


def _per_output_us(fn: Callable[[Any], Any], arg: Any, outputs: int, seconds: float) -> float:
    """Best of five timings of `fn(arg)`, in microseconds per output."""
    best = float("inf")
    for _ in range(5):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / 5:
            fn(arg)
            calls += 1
        best = min(best, elapsed / calls)
    return best / outputs * 1e6


@click.command()
@click.option("--sizes", default="8,64,256", show_default=True,
              help="outputs per batch (comma-separated)")
@click.option("--seconds", default=1.0, show_default=True, help="per timing")
def main(sizes: str, seconds: float) -> None:
    print("us per output   | build+serialize      | parse+read")
    print("outputs  hop          | per-request  packed | per-request  packed")
    for n in (int(s) for s in sizes.split(",")):
        items = _items(n)
        for hop, old, new in (("scheduler", _per_request, _packed),
                              ("detokenizer", _text_per_request, _text_packed)):
            read_old = _read_per_request if hop == "scheduler" else _read_per_request_text
            read_new = _read_packed if hop == "scheduler" else _read_packed_text
            figures = (_per_output_us(old, items, n, seconds),
                       _per_output_us(new, items, n, seconds),
                       _per_output_us(read_old, old(items), n, seconds),
                       _per_output_us(read_new, new(items), n, seconds))
            print(f"{n:7d}  {hop:12s} | {figures[0]:11.3f} {figures[1]:7.3f} | "
                  f"{figures[2]:11.3f} {figures[3]:7.3f}")


if __name__ == "__main__":
    main()
