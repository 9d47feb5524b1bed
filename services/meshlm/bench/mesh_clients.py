"""`make bench`'s load generator for the mesh: each round's warm-up, TTFT at concurrency 1
and saturation phase over the gateway's gRPC port (the lean client of raw_grpc.py, or
grpc.aio's) and over its HTTP port (SGLang's /generate, SSE, raw_http.py), each message timed
as it arrives."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import grpc
import httpx
import orjson
from tqdm import tqdm

from meshlm.bench.load import Saturation, limited, prompt
from meshlm.bench.mesh_report import Result
from meshlm.bench.proc_cpu import cpu_delta
from meshlm.bench.raw_grpc import GrpcConnection
from meshlm.bench.raw_http import SsePool
from meshlm.bench.saturated import Arrivals
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

# -- mesh over gRPC ---------------------------------------------------------------------------

class Streamed(NamedTuple):
    """One streamed request as its client saw it: seconds to its first message, its output
    tokens, the longest wait between two of its messages, and how many messages came."""

    ttft: float
    tokens: int
    longest_gap: float
    messages: int


class Gaps:
    """The longest wait between two consecutive messages of a stream, and their count."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.longest = 0.0
        self.count = 0

    def seen(self) -> float:
        self.count += 1
        now = time.perf_counter()
        if self.last is not None:
            self.longest = max(self.longest, now - self.last)
        self.last = now
        return now


class _Watch:
    """One streamed TextGenerate call as its client sees it, message by message."""

    def __init__(self, arrivals: Arrivals | None) -> None:
        self.arrivals = arrivals
        self.start = time.perf_counter()
        self.first: float | None = None
        self.tokens = 0
        self.gaps = Gaps()

    def message(self, msg: pb.TextGenerateResponse) -> bool:
        """Count one message; whether it is the call's last."""
        now = self.gaps.seen()
        if self.first is None:
            self.first = now - self.start
            if self.arrivals is not None:
                self.arrivals.first(now)
        if self.arrivals is not None:
            self.arrivals.add(now, len(msg.output_ids))
        if msg.finished:
            self.tokens = int(msg.meta_info["completion_tokens"])
        return msg.finished

    def streamed(self) -> Streamed:
        return Streamed(self.first or 0.0, self.tokens, self.gaps.longest, self.gaps.count)


def _text_generate(text: str, new_tokens: int) -> pb.TextGenerateRequest:
    return pb.TextGenerateRequest(text=text, stream=True, sampling_params=pb.SamplingParams(
        temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))


async def _grpc_one(stub: sglang_pb2_grpc.SglangServiceStub, text: str, new_tokens: int,
                    arrivals: Arrivals | None = None) -> Streamed:
    watch = _Watch(arrivals)
    async for msg in stub.TextGenerate(_text_generate(text, new_tokens)):
        watch.message(msg)
    return watch.streamed()


def engine_totals(stub: sglang_pb2_grpc.SglangServiceStub) -> tuple[int, float]:
    """Engine steps and their forward passes' CPU seconds so far, every scheduler's (GetLoad's
    steps_total and forward_cpu_seconds_total)."""
    loads = orjson.loads(stub.GetLoad(pb.GetLoadRequest(), timeout=10).json_info)
    return (sum(int(load.get("steps_total", 0)) for load in loads),
            sum(float(load.get("forward_cpu_seconds_total", 0.0)) for load in loads))


async def _drive(name: str, one: Callable[..., Awaitable[Streamed]], n_warm: int, n_ttft: int,
                 sat: Saturation, measure: Callable[[], dict[str, float]],
                 totals: Callable[[], tuple[int, float]]) -> Result:
    """One transport's round: `n_warm` requests, TTFT at concurrency 1, then the saturation
    phase. `one(text, new_tokens, arrivals=None)` streams one request."""
    for i in range(n_warm):
        await one(prompt(i, 16), 2)
    ttft = [(await one(prompt(i, 16), 1)).ttft
            for i in tqdm(range(n_ttft), desc=f"{name.split()[-1].lower()} ttft", leave=False)]
    totals_before, cpu_before, start = totals(), measure(), time.perf_counter()
    arrivals = Arrivals()
    results = await limited(sat.in_flight, [
        functools.partial(one, text, k, arrivals) for text, k in sat.requests])
    seconds, cpu = time.perf_counter() - start, cpu_delta(cpu_before, measure())
    steps, forward = (after - before for after, before in zip(totals(), totals_before,
                                                               strict=True))
    return Result(name, ttft, sum(r.tokens for r in results), seconds, cpu, steps=int(steps),
                  longest_gap=max(r.longest_gap for r in results),
                  saturated=arrivals.window(sat.concurrency),
                  messages=sum(r.messages for r in results), forward=forward,
                  fills=(arrivals.fill_seconds(sat.concurrency, start),))


_TEXT_GENERATE = "/sglang.runtime.v1.SglangService/TextGenerate"


async def _raw_grpc_one(conn: GrpcConnection, text: str, new_tokens: int,
                        arrivals: Arrivals | None = None) -> Streamed:
    """_grpc_one over the lean client: each message is read where it arrives (raw_grpc.py)."""
    watch = _Watch(arrivals)
    parse = pb.TextGenerateResponse.FromString
    await conn.call(_TEXT_GENERATE, _text_generate(text, new_tokens).SerializeToString(),
                    lambda data: watch.message(parse(data)))
    return watch.streamed()


async def bench_grpc(address: str, n_warm: int, n_ttft: int, sat: Saturation,
                     measure: Callable[[], dict[str, float]],
                     totals: Callable[[], tuple[int, float]], client: str = "raw") -> Result:
    if client == "raw":
        host, _, port = address.rpartition(":")
        conn = await GrpcConnection.open(host, int(port))
        try:
            one = functools.partial(_raw_grpc_one, conn)
            return await _drive("mesh gRPC", one, n_warm, n_ttft, sat, measure, totals)
        finally:
            conn.close()
    async with grpc.aio.insecure_channel(address) as channel:
        one = functools.partial(_grpc_one, sglang_pb2_grpc.SglangServiceStub(channel))
        return await _drive("mesh gRPC", one, n_warm, n_ttft, sat, measure, totals)


# -- mesh over HTTP ---------------------------------------------------------------------------

async def _http_one(pool: SsePool, text: str, new_tokens: int,
                    arrivals: Arrivals | None = None) -> Streamed:
    body = orjson.dumps({"text": text, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})
    start = time.perf_counter()
    first: list[float] = []
    last = [b""]
    gaps = Gaps()
    came = 0  # tokens so far (each event's meta_info counts them all)

    def on_event(event: bytes) -> None:
        nonlocal came
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return
        now = gaps.seen()
        if not first:
            first.append(now - start)
            if arrivals is not None:
                arrivals.first(now)
        if arrivals is not None:
            at = event.rfind(b'"completion_tokens":') + len(b'"completion_tokens":')
            so_far = int(event[at:event.find(b",", at)])
            arrivals.add(now, so_far - came)
            came = so_far
        last[0] = event

    await pool.stream("/generate", body, on_event)
    tokens = int(orjson.loads(last[0][6:])["meta_info"]["completion_tokens"]) if last[0] else 0
    return Streamed(first[0] if first else 0.0, tokens, gaps.longest, gaps.count)


async def bench_http(base: str, n_warm: int, n_ttft: int, sat: Saturation,
                     measure: Callable[[], dict[str, float]],
                     totals: Callable[[], tuple[int, float]]) -> Result:
    url = httpx.URL(base)
    pool = SsePool(url.host, url.port or 80)
    try:
        one = functools.partial(_http_one, pool)
        return await _drive("mesh HTTP", one, n_warm, n_ttft, sat, measure, totals)
    finally:
        pool.close()

