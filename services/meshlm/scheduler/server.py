"""Scheduler service: the engine behind a gRPC face.

Tokenizers stream requests in (Submit) to the engine loop (loop.py), which runs schedule ->
execute -> postprocess (the forward pass on the engine thread, all scheduling state on the event
loop) and sends each step's outputs as one TokenBatch per detokenizer. Abort ends requests
between steps; FlushCache, Pause, Continue and UpdateWeights (control.py) run between steps too
(the engine loop runs them before planning the next). This module holds the configuration, the
servicer and the wiring.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from meshlm.common import config as cfg
from meshlm.common.affinity import name_thread, parse_cpu_list
from meshlm.common.logs import get_logger
from meshlm.common.metrics import SchedulerMetrics
from meshlm.common.packed import Plain, packer
from meshlm.common.profiling import Profiling, profiler_binding
from meshlm.common.roles import MESH_PORTS
from meshlm.common.server import Binding, Sink
from meshlm.common.service import (
    MeshPeers,
    ServiceConfig,
    advertised,
    mesh_server,
    model_info_json,
    resolve_model_path,
    serve_until_signal,
    start_mesh_server,
)
from meshlm.common.streams import StreamPool
from meshlm.scheduler import wire
from meshlm.scheduler.control import EngineControl
from meshlm.scheduler.cpus import (
    DEFAULT_MESH_US,
    ENGINE_THREAD,
    EngineCpus,
    auto_threads,
    usable_cpus,
)
from meshlm.scheduler.engine.engine import Engine, EngineConfig, SamplingParams
from meshlm.scheduler.grammar import Grammars
from meshlm.scheduler.loop import EngineLoop
from meshlm.scheduler.placement import StepPlacement, check_mode, choose
from meshlm.scheduler.torch_trace import EngineTorchTrace
from meshlm.scheduler.watchdog import DEFAULT_STALL_TIMEOUT
from meshlm.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2
from meshlm.v1 import scheduler_pb2_grpc as pb_grpc

log = get_logger(__name__)


@dataclass
class SchedulerConfig(ServiceConfig):
    """meshlm scheduler service (the engine)."""

    port: int = cfg.field(MESH_PORTS["scheduler"],
                          "mesh gRPC port (mutual TLS); 0 picks a free port")
    model_path: str = cfg.field("", "checkpoint directory (HF layout); empty = embedded default")
    device: str = cfg.field("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = cfg.field("auto", "auto | float32 | bfloat16 | float16")
    load_format: str = cfg.field("auto", "auto | safetensors | dummy (random weights from "
                                         "config.json)")
    max_running: int = cfg.field(64, "requests in the running batch")
    max_batched_tokens: int = cfg.field(2048, "tokens per engine step (decodes + prompt "
                                              "chunks); longer prompts are chunked")
    max_model_len: int = cfg.field(0, "context length; 0 = the checkpoint's")
    block_size: int = cfg.field(16, "tokens per KV cache block")
    kv_cache_bytes: int = cfg.field(0, "KV cache budget in bytes; 0 = auto (CUDA: "
                                       "mem-fraction; CPU: max-running full sequences, <= 2 GiB)")
    num_kv_blocks: int = cfg.field(0, "KV cache blocks; overrides kv-cache-bytes when set")
    mem_fraction: float = cfg.field(0.85, "CUDA: share of device memory for weights + KV")
    prefix_cache: bool = cfg.field(True, "reuse the KV of shared prompt prefixes")
    packed_linears: bool = cfg.field(True, "CPU: pack the decoder's weights once, for "
                                           "meshlm's matmul kernel (AVX-512, native "
                                           "backend) or oneDNN's (faster small batches)")
    packed_weight_dtype: str = cfg.field("auto", "CPU: the packed linears' weights: auto (the "
                                                 "model's) | bfloat16 (half the memory and "
                                                 "what a decode step reads; meshlm's matmul "
                                                 "kernel, native backend, float32 model)")
    attention_backend: str = cfg.field("auto", "native (meshlm's C kernels for attention and "
                                               "the layers' work between matmuls, built at "
                                               "start-up with the machine's C compiler: CPU, "
                                               "float32) | torch | auto (native where it "
                                               "serves, else torch)")
    kv_cache_dtype: str = cfg.field("auto", "KV cache element type: auto (the model's) | "
                                            "float32 | bfloat16 | float16 (half the memory "
                                            "and bandwidth of float32)")
    num_threads: int = cfg.field(0, "torch CPU threads; 0 = auto: on the CPU, the engine's "
                                    "share of the cores, measured at start-up (cpus.py)")
    engine_cpus: str = cfg.field("", "CPUs the service runs on, engine and event loop (a "
                                     "list: 0-1,3), one engine thread each unless "
                                     "--num-threads says; empty = no pinning")
    cpus: float = cfg.field(0.0, "cores this scheduler counts as its own for auto threads; "
                                 "0 = what it may use (affinity mask, cgroup CPU quota)")
    mesh_cpu_us: float = cfg.field(DEFAULT_MESH_US, "CPU us per output token the rest of the "
                                                    "mesh spends on these cores, for auto "
                                                    "threads (make bench measures it); 0 = "
                                                    "the engine has the cores to itself")
    engine_steps: str = cfg.field("auto", "where the forward passes run: thread (the "
                                          "engine's own, while the event loop sends and "
                                          "receives), loop (the event loop, steps of up to "
                                          "20 ms), or auto (loop on one CPU without a GPU: "
                                          "placement.py)")
    max_queued: int = cfg.field(1024, "requests waiting for a running slot; beyond it a new "
                                      "request ends at once with RESOURCE_EXHAUSTED")
    stream_interval: int = cfg.field(1, "a streaming request's tokens per output after its "
                                        "first (SGLang's --stream-interval): larger sends "
                                        "fewer, larger messages through the mesh to the "
                                        "client, for less CPU per token")
    stall_timeout: float = cfg.field(DEFAULT_STALL_TIMEOUT,
                                     "seconds one engine step may run before the scheduler "
                                     "counts as stalled (NOT_SERVING, its requests end "
                                     "UNAVAILABLE) until the step returns; must exceed the "
                                     "longest step (a --max-batched-tokens prompt chunk; large "
                                     "models on CPU need more); 0 = off")


class SchedulerServicer(pb_grpc.SchedulerServicer):
    """The gRPC face of the scheduler: each RPC calls the engine loop (requests in, aborts,
    load) or the control calls (flush, pause, weights)."""

    def __init__(self, loop: EngineLoop, control: EngineControl) -> None:
        self.loop = loop
        self.control = control

    async def Submit(self, request_iterator: AsyncIterator[scheduler_pb2.TokenizedBatch],
                     context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        async for batch in request_iterator:  # on the native server: none (`sinks`)
            self.loop.submit(batch)
        return common_pb2.Empty()

    def sinks(self) -> dict[str, Sink]:
        """Submit's batches admitted as they arrive (on the native server): no task switch
        and no loop turn between a tokenizer's batch and the engine loop's wake-up."""
        return {"Submit": Sink(scheduler_pb2.TokenizedBatch, self.loop.submit)}

    async def Abort(self, request: scheduler_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.AbortResponse:
        aborted = self.loop.abort(request.rids, every=request.all, reason=request.reason)
        return scheduler_pb2.AbortResponse(aborted=aborted)

    async def GetLoad(self, request: scheduler_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> scheduler_pb2.Load:
        return wire.load_of(self.loop.address, self.loop.engine.stats())

    async def GetInfo(self, request: common_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return self.control.info

    async def FlushCache(self, request: scheduler_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.FlushCacheResponse:
        return await self.control.flush_cache()

    async def Pause(self, request: scheduler_pb2.PauseRequest,
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.PauseResponse:
        return await self.control.pause(request.mode)

    async def Continue(self, request: scheduler_pb2.ContinueRequest,
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.ContinueResponse:
        return await self.control.resume()

    async def UpdateWeights(self, request: scheduler_pb2.UpdateWeightsRequest,
                            context: grpc.aio.ServicerContext
                            ) -> scheduler_pb2.UpdateWeightsResponse:
        return await self.control.update_weights(request)


def _warm_up(engine: Engine) -> None:
    """One tiny request before SERVING, so the first client does not pay for torch's
    first-call set-up (hundreds of ms on CPU)."""
    if engine.model_config.has_lm_head:
        engine.add_request("meshlm-warm-up", [0, 1, 2, 3], SamplingParams(
            temperature=0.0, max_new_tokens=2, ignore_eos=True))
    else:
        engine.add_embed_request("meshlm-warm-up", [0, 1, 2, 3])
    while engine.has_work():
        engine.step()


async def _placement(mode: str, engine: Engine, executor: ThreadPoolExecutor,
                     torch_trace: EngineTorchTrace) -> StepPlacement:
    """Where the steps run (placement.py), logged; steps on the loop get the engine's torch
    threads there too."""
    import torch

    threads = await asyncio.get_running_loop().run_in_executor(executor, torch.get_num_threads)
    on_loop, why = choose(mode, str(engine.device), usable_cpus(), threads)
    if on_loop:
        torch.set_num_threads(threads)
    log.info("engine_steps", on="event loop, up to 20 ms a step" if on_loop else "engine thread",
             why=why)
    return StepPlacement(on_loop, held=lambda: torch_trace.recording)


async def serve(config: SchedulerConfig) -> None:
    check_mode(config.engine_steps)
    model_path = resolve_model_path(config.model_path)
    # Every torch call happens on this one thread, the engine's: the model is built here too.
    # (Torch from a second thread brings a second OpenMP pool whose spinning workers halve the
    # speed of both on a small machine.) The one exception: on one CPU with one torch thread,
    # which has no pool, short steps run on the event loop (placement.py).
    cpu_plan = (EngineCpus.pinned(parse_cpu_list(config.engine_cpus), config.num_threads)
                if config.engine_cpus else EngineCpus(config.num_threads))
    cpu_plan.pin_process()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine",
                                  initializer=name_thread, initargs=(ENGINE_THREAD,))
    engine = await asyncio.get_running_loop().run_in_executor(executor, Engine, EngineConfig(
        model_path=model_path, device=config.device, dtype=config.dtype,
        load_format=config.load_format, max_running=config.max_running,
        max_batched_tokens=config.max_batched_tokens,
        max_model_len=config.max_model_len or None, num_threads=cpu_plan.threads or None,
        block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
        kv_cache_bytes=config.kv_cache_bytes, mem_fraction=config.mem_fraction,
        enable_prefix_cache=config.prefix_cache, packed_cpu_linears=config.packed_linears,
        attention_backend=config.attention_backend, kv_cache_dtype=config.kv_cache_dtype,
        packed_weight_dtype=config.packed_weight_dtype,
    ))
    await asyncio.get_running_loop().run_in_executor(executor, _warm_up, engine)
    if not cpu_plan.threads and engine.device == "cpu":
        await asyncio.get_running_loop().run_in_executor(
            executor, auto_threads, engine, config.mesh_cpu_us, config.cpus or None)
    peers = MeshPeers(config)

    def on_detokenizer_lost(address: str) -> None:  # streams start after the loop exists
        loop.detokenizer_lost(address)

    outputs: StreamPool[detokenizer_pb2.TokenOutput | Plain] = peers.stream_pool(
        "scheduler->detokenizer", "detokenizer",
        lambda ch: detokenizer_pb2_grpc.DetokenizerStub(ch).Push,
        packer(detokenizer_pb2.TokenBatch), on_lost=on_detokenizer_lost, write_through=True)
    info = common_pb2.ModelInfo(
        model_path=model_path, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
        eos_token_ids=sorted(engine.eos_token_ids),
        json_info=model_info_json(model_path, {"device": str(engine.device),
                                               "max_running": config.max_running}),
    )
    torch_trace = EngineTorchTrace(executor)
    profiling = Profiling("scheduler", torch_trace)
    placement = await _placement(config.engine_steps, engine, executor, torch_trace)
    loop = EngineLoop(engine, executor, outputs, profiling.events, max_queued=config.max_queued,
                      stall_timeout=config.stall_timeout, stream_interval=config.stream_interval,
                      placement=placement,
                      grammars=Grammars(model_path, engine.vocab_size, engine.eos_token_ids))
    servicer = SchedulerServicer(loop, EngineControl(engine, loop, info))
    server = mesh_server(config, [Binding(pb_grpc.add_SchedulerServicer_to_server, servicer,
                                          "meshlm.v1.Scheduler", servicer.sinks()),
                                  profiler_binding(profiling)])
    bound = await start_mesh_server(server, config, peers.tls)
    loop.address = advertised(config, bound)
    loop.watchdog.report = server.set_serving
    engine_task = asyncio.create_task(loop.run(), name="engine")
    metrics = SchedulerMetrics(Path(model_path).name, engine.stats)
    await serve_until_signal(server, config, bound, watch=engine_task, metrics=metrics,
                             on_stop=loop.watchdog.stop,
                             model_path=model_path, device=str(engine.device),
                             max_running=config.max_running, stall_timeout=config.stall_timeout,
                             role="scheduler")
    engine_task.cancel()
    loop.close()
    await peers.close()
