"""`make bench`: the engine in-process vs the mesh over gRPC vs the mesh over HTTP, one run.

Prints TTFT p50/p99 at concurrency 1 and output tokens/s at saturation for each path, and the
ratios between them. Machines are shared and noisy: compare the ratios of one run.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import grpc
import httpx
import orjson
from tqdm import tqdm

from meshlm.common.default_model import ensure_default_model
from meshlm.launch.mesh import Mesh, MeshOptions
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

WORDS = "the river runs past a quiet town where lanterns glow in winter light".split()


def prompt(i: int, length: int) -> str:
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(length))


@dataclass
class Result:
    name: str
    ttft: list[float]
    tokens: int
    seconds: float

    @property
    def p50(self) -> float:
        return statistics.median(self.ttft) * 1000

    @property
    def p99(self) -> float:
        q = sorted(self.ttft)
        return q[min(len(q) - 1, int(round(0.99 * (len(q) - 1))))] * 1000

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


# -- in-process -------------------------------------------------------------------------------

def bench_engine(model_path: str, n_ttft: int, n_sat: int, new_tokens: int,
                 max_running: int, threads: int) -> Result:
    from meshlm.scheduler.engine.engine import Engine, EngineConfig, SamplingParams
    from meshlm.tokenizer.tokenization import TextTokenizer

    tok = TextTokenizer.from_pretrained(model_path)
    engine = Engine(EngineConfig(model_path=model_path, max_running=max_running,
                                 num_threads=threads or None))
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    ttft = []
    for i in tqdm(range(n_ttft), desc="engine ttft", leave=False):
        start = time.perf_counter()
        engine.add_request(f"t{i}", tok.encode(prompt(i, 16)), SamplingParams(
            temperature=0.0, max_new_tokens=1, ignore_eos=True))
        while engine.has_work():
            if any(o.new_token_ids for o in engine.step()):
                ttft.append(time.perf_counter() - start)
    ids = [tok.encode(prompt(i, 16)) for i in range(n_sat)]
    start = time.perf_counter()
    for i, p in enumerate(ids):
        engine.add_request(f"s{i}", p, params)
    tokens = 0
    while engine.has_work():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return Result("in-process", ttft, tokens, time.perf_counter() - start)


# -- mesh over gRPC ---------------------------------------------------------------------------

async def _grpc_one(stub: sglang_pb2_grpc.SglangServiceStub, text: str, new_tokens: int
                    ) -> tuple[float, int]:
    req = pb.TextGenerateRequest(text=text, stream=True, sampling_params=pb.SamplingParams(
        temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    start = time.perf_counter()
    first = None
    tokens = 0
    async for msg in stub.TextGenerate(req):
        if first is None:
            first = time.perf_counter() - start
        if msg.finished:
            tokens = int(msg.meta_info["completion_tokens"])
    return first or 0.0, tokens


async def bench_grpc(address: str, n_ttft: int, n_sat: int, new_tokens: int) -> Result:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = sglang_pb2_grpc.SglangServiceStub(channel)
        await _grpc_one(stub, "warm up", 2)
        ttft = [(await _grpc_one(stub, prompt(i, 16), 1))[0]
                for i in tqdm(range(n_ttft), desc="grpc ttft", leave=False)]
        start = time.perf_counter()
        results = await asyncio.gather(*(_grpc_one(stub, prompt(i, 16), new_tokens)
                                         for i in range(n_sat)))
        return Result("mesh gRPC", ttft, sum(t for _, t in results), time.perf_counter() - start)


# -- mesh over HTTP ---------------------------------------------------------------------------

async def _http_one(client: httpx.AsyncClient, url: str, text: str, new_tokens: int
                    ) -> tuple[float, int]:
    body = {"text": text, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - start
            chunk = orjson.loads(line[6:])
            tokens = chunk["meta_info"]["completion_tokens"]
    return first or 0.0, tokens


async def bench_http(base: str, n_ttft: int, n_sat: int, new_tokens: int) -> Result:
    url = f"{base}/generate"
    limits = httpx.Limits(max_connections=n_sat + 4, max_keepalive_connections=n_sat + 4)
    # TCP_NODELAY as curl and browsers set it: otherwise Nagle + delayed ACK add ~40 ms.
    transport = httpx.AsyncHTTPTransport(
        limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    async with httpx.AsyncClient(timeout=600, transport=transport) as client:
        await _http_one(client, url, "warm up", 2)
        ttft = [(await _http_one(client, url, prompt(i, 16), 1))[0]
                for i in tqdm(range(n_ttft), desc="http ttft", leave=False)]
        start = time.perf_counter()
        results = await asyncio.gather(*(_http_one(client, url, prompt(i, 16), new_tokens)
                                         for i in range(n_sat)))
        return Result("mesh HTTP", ttft, sum(t for _, t in results), time.perf_counter() - start)


def report(results: list[Result]) -> str:
    base = results[0]
    lines = [f"{'path':<12} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'out tok/s':>10}"]
    for r in results:
        lines.append(f"{r.name:<12} {r.p50:>12.2f} {r.p99:>12.2f} {r.throughput:>10.1f}")
    lines.append("")
    for r in results[1:]:
        lines.append(f"{r.name} vs {base.name}: TTFT p50 +{r.p50 - base.p50:.2f} ms, "
                     f"throughput {r.throughput / base.throughput:.1%}")
    grpc_r, http_r = results[1], results[2]
    lines.append(f"gRPC vs HTTP: TTFT p50 {grpc_r.p50 / http_r.p50:.2f}x, "
                 f"throughput {grpc_r.throughput / http_r.throughput:.2f}x")
    return "\n".join(lines)


def _env_overrides() -> dict[str, str]:
    """MESHLM_BENCH_<NAME>=value sets MESHLM_<NAME> for the mesh's services only."""
    import os

    prefix = "MESHLM_BENCH_"
    return {"MESHLM_" + k[len(prefix):]: v for k, v in os.environ.items() if k.startswith(prefix)}


@click.command()
@click.option("--model-path", default="", envvar="MESHLM_MODEL_PATH",
              help="checkpoint (default: the embedded model)")
@click.option("--ttft-requests", default=50, show_default=True)
@click.option("--saturation-requests", default=64, show_default=True)
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--engine-threads", default=0, show_default=True,
              help="torch CPU threads for the engine, in-process and in the mesh (0 = torch's "
                   "default)")
def main(model_path: str, ttft_requests: int, saturation_requests: int, new_tokens: int,
         engine_threads: int) -> None:
    model_path = model_path or str(ensure_default_model())
    results = [bench_engine(model_path, ttft_requests, saturation_requests, new_tokens,
                            max_running=saturation_requests, threads=engine_threads)]
    with tempfile.TemporaryDirectory() as tmp:
        options = MeshOptions(workdir=Path(tmp), model_path=model_path, http_port=0,
                              grpc_port=0,
                              env={"MESHLM_MAX_RUNNING": str(saturation_requests),
                                   "MESHLM_NUM_THREADS": str(engine_threads),
                                   "MESHLM_LOG_LEVEL": "warning", **_env_overrides()})
        with Mesh(options) as mesh:
            results.append(asyncio.run(bench_grpc(mesh.addresses.gateway_grpc, ttft_requests,
                                                  saturation_requests, new_tokens)))
            results.append(asyncio.run(bench_http(mesh.addresses.gateway_http, ttft_requests,
                                                  saturation_requests, new_tokens)))
    import os

    import torch

    threads = engine_threads or torch.get_num_threads()
    print(f"\nmodel: {model_path}; TTFT at concurrency 1 ({ttft_requests} requests), "
          f"throughput at {saturation_requests} concurrent x {new_tokens} tokens; "
          f"engine threads {threads}; {os.cpu_count()} CPUs shared by every process\n")
    print(report(results))


if __name__ == "__main__":
    main()
