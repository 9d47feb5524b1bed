"""Helpers for the engine tests: tiny random Llama checkpoints (HF layout), run loops, and the
scheduler service's parts over an engine (no gRPC server): outputs collected, requests made."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from meshlm.common.packed import Plain, packer, unpack
from meshlm.scheduler.control import EngineControl
from meshlm.scheduler.engine.engine import Engine, SamplingParams, StepOutput
from meshlm.scheduler.loop import EngineLoop
from meshlm.scheduler.server import SchedulerServicer
from meshlm.scheduler.watchdog import DEFAULT_STALL_TIMEOUT
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2

EOS = 2
# The engines' device: cpu here and in CI. MESHLM_TEST_DEVICE=cuda runs the engine fixtures'
# tests on a GPU where one is at hand; DEVICES is what device-parametrised tests run on.
TEST_DEVICE = os.environ.get("MESHLM_TEST_DEVICE", "cpu")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# On a GPU the engines' default KV budget is a share of the card less what is in use: the
# tests' engines live side by side, so each gets a small fixed budget there (0: the CPU's
# default, room for max_running full sequences).
GPU_TEST_KV_BYTES = 0 if TEST_DEVICE == "cpu" else 64 << 20

EngineFactory = Callable[..., Engine]  # the make_engine fixture


def write_checkpoint(
    path: Path,
    *,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    tied: bool = False,
    max_positions: int = 256,
    torch_dtype: str = "float32",
    seed: int = 0,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write config.json + model.safetensors. Large embedding/head weights keep logits peaked
    so greedy ties are rare."""
    path.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_positions,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "torch_dtype": torch_dtype,
        "eos_token_id": EOS,
        "bos_token_id": 1,
        "hidden_act": "silu",
        **(extra_config or {}),
    }
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    d = hidden // heads
    t = {
        "model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rand(heads * d, hidden)
        t[p + "self_attn.k_proj.weight"] = rand(kv_heads * d, hidden)
        t[p + "self_attn.v_proj.weight"] = rand(kv_heads * d, hidden)
        t[p + "self_attn.o_proj.weight"] = rand(hidden, heads * d)
        t[p + "mlp.gate_proj.weight"] = rand(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = rand(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = rand(hidden, intermediate)
        t[p + "input_layernorm.weight"] = 1 + rand(hidden, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + rand(hidden, scale=0.1)
    if not tied:
        t["lm_head.weight"] = rand(vocab, hidden, scale=1.0)
    save_file(t, str(path / "model.safetensors"))
    return path


def run_all(engine: Engine, max_steps: int = 10_000) -> dict[str, list[StepOutput]]:
    """Step until idle; outputs grouped by rid."""
    outs: dict[str, list[StepOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
    raise AssertionError("engine did not go idle")


def tokens_of(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def greedy(max_new_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


@torch.inference_mode()
def reference_greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """Token-by-token greedy decoding by full recompute (no KV cache)."""
    ids = torch.tensor([prompt], device=engine.device)
    out: list[int] = []
    for _ in range(n):
        token = int(engine.model.forward_full(ids)[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]], device=engine.device)], dim=1)
    return out


class Outputs:
    """Stands in for the scheduler's stream pool to the detokenizers: collects every output,
    each put sent through the wire's batch (packed as the stream packs it, serialized, parsed)
    and read back as whole TokenOutputs."""

    def __init__(self) -> None:
        self.items: list[detokenizer_pb2.TokenOutput] = []
        self.news = asyncio.Event()
        self._make_batch = packer(detokenizer_pb2.TokenBatch)

    def get(self, address: str) -> Outputs:
        return self

    async def put(self, items: list[detokenizer_pb2.TokenOutput | Plain]) -> None:
        self.put_nowait(items)

    def put_nowait(self, items: list[detokenizer_pb2.TokenOutput | Plain]) -> None:
        batch = detokenizer_pb2.TokenBatch.FromString(
            self._make_batch(list(items)).SerializeToString())
        for item in unpack(batch.outputs, batch.packed):
            if isinstance(item, tuple):
                rid, ids, prompt, completion, cached, _ = item
                item = detokenizer_pb2.TokenOutput(
                    rid=rid, token_ids=ids, prompt_tokens=prompt, completion_tokens=completion,
                    cached_tokens=cached)
            self.items.append(item)
        self.news.set()

    def of(self, rid: str) -> list[detokenizer_pb2.TokenOutput]:
        return [o for o in self.items if o.rid == rid]

    async def until(self, predicate: Callable[[], bool], timeout: float = 30) -> None:
        """Wait until `predicate()` holds, checked after every put."""
        async def wait() -> None:
            while not predicate():
                self.news.clear()
                await self.news.wait()
        await asyncio.wait_for(wait(), timeout)

    async def finished(self, rids: set[str]) -> dict[str, list[detokenizer_pb2.TokenOutput]]:
        """Wait until every rid has finished; its outputs by rid."""
        await self.until(lambda: rids <= {o.rid for o in self.items if o.finished})
        by_rid: dict[str, list[detokenizer_pb2.TokenOutput]] = {}
        for o in self.items:
            by_rid.setdefault(o.rid, []).append(o)
        return by_rid


def make_servicer(engine: Engine, outputs: Outputs | None = None,
                  info: common_pb2.ModelInfo | None = None, *,
                  executor: ThreadPoolExecutor | None = None, max_queued: int = 1024,
                  stall_timeout: float = DEFAULT_STALL_TIMEOUT) -> SchedulerServicer:
    """The scheduler's servicer as serve() wires it (address "s"), outputs into `outputs`;
    its engine loop is not running yet (`servicer.loop.run()`)."""
    loop = EngineLoop(engine, executor or ThreadPoolExecutor(1), outputs or Outputs(),
                      address="s", max_queued=max_queued, stall_timeout=stall_timeout)
    return SchedulerServicer(loop, EngineControl(engine, loop, info or common_pb2.ModelInfo()))


def sample_prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 500 for i in range(n)]


def tokenized(rid: str, prompt: list[int], **kw: Any) -> scheduler_pb2.TokenizedRequest:
    """A greedy streaming request for 4 tokens (EOS ignored; each output sent at once),
    routed to detokenizer "d"; `kw` are more RequestMeta fields."""
    sampling = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1,
                                         repetition_penalty=1.0, max_new_tokens=4,
                                         ignore_eos=True, logprob_start_len=-1)
    meta = common_pb2.RequestMeta(rid=rid, sampling=sampling,
                                  route=common_pb2.Route(detokenizer="d"),
                                  **{"stream": True, **kw})
    return scheduler_pb2.TokenizedRequest(meta=meta, input_ids=prompt)


async def submit(servicer: SchedulerServicer, *reqs: scheduler_pb2.TokenizedRequest) -> None:
    """One Submit call carrying one batch."""
    async def batches() -> AsyncIterator[scheduler_pb2.TokenizedBatch]:
        yield scheduler_pb2.TokenizedBatch(requests=reqs)

    await servicer.Submit(batches(), None)  # type: ignore[arg-type]
