"""Engine: the public surface of the inference engine (policy + model runner).

A step is three calls, split so that a server can run the forward pass off its event loop:

    plan = engine.schedule()                                  # loop thread
    result = engine.execute(plan) if plan else None           # executor thread
    outputs = engine.postprocess(plan, result)                # loop thread

`add_request`, `abort`, `schedule`, `postprocess` and `stats` belong to one thread (the loop);
`execute` may run concurrently with `add_request` and `abort`, never with `schedule` or
`postprocess`, and at most one plan is in flight. `pause`, `resume`, `flush_cache`, `drop_kv`
and `load_weights` run between steps (no plan in flight). `step()` chains the three for
in-process use.

New weights without a restart are split by thread the same way (weights.py):

    checkpoint = engine.check_weights(path, load_format)   # any thread, no torch: refusals
    retracted = engine.drop_kv()                           # loop thread, between steps
    engine.load_weights(checkpoint)                        # engine thread, between steps
    engine.update_weights(path, load_format)               # the three, on the calling thread
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from meshlm.common.logs import get_logger
from meshlm.common.memory import retain_freed_memory
from meshlm.scheduler.engine.kv_cache import KVCache
from meshlm.scheduler.engine.model_runner import ModelRunner
from meshlm.scheduler.engine.policy import BatchPlanner
from meshlm.scheduler.engine.sequence import ExecResult, Plan, SamplingParams, StepOutput
from meshlm.scheduler.engine.weights import ServedWeights, WeightsLoadError, WeightsUpdate
from meshlm.scheduler.kernels import native
from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.cpu_linear import native_packing, pack_linears
from meshlm.scheduler.models.loader import load_model, resolve_dtype
from meshlm.scheduler.models.reload import Checkpoint

__all__ = ["Engine", "EngineConfig", "ExecResult", "Plan", "SamplingParams", "StepOutput"]

log = get_logger(__name__)


@dataclass
class EngineConfig:
    """What the engine serves and how much it may hold at once."""

    model_path: str
    device: str = "auto"  # "auto" = cuda if available else cpu
    dtype: str = "auto"  # auto = config.json torch_dtype, else float32
    max_running: int = 64  # requests in the running batch
    max_batched_tokens: int = 2048  # tokens per step (decodes + prompt chunks)
    max_model_len: int | None = None  # default: config max_position_embeddings
    load_format: str = "auto"  # auto = the safetensors; dummy = seeded random weights
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = 0  # 0 = from the memory budget below
    kv_cache_bytes: int = 0  # KV budget; 0 = auto (CUDA: mem_fraction; CPU: see below)
    mem_fraction: float = 0.85  # CUDA: share of device memory for weights + KV cache
    enable_prefix_cache: bool = True
    packed_cpu_linears: bool = True  # CPU: decoder projections prepacked for oneDNN
    attention_backend: str = "auto"  # native (meshlm's C kernels), torch, auto
    kv_cache_dtype: str = "auto"  # auto = the model's dtype; or a `resolve_dtype` name
    packed_weight_dtype: str = "auto"  # CPU packed linears: auto (the model's) | bfloat16


# CPU, auto budget: room for max_running full-length sequences, but at most this much.
CPU_KV_BYTES_CAP = 2 * 2**30


ATTENTION_BACKENDS = ("auto", "native", "torch")


def cpu_kernels(backend: str, mc: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype,
                device: torch.device) -> native.Kernels | None:
    """The kernels `backend` asks for: native (meshlm's C kernels, built on first use: CPU,
    float32, a float32, bfloat16 or float16 KV cache), torch (torch ops, any device), or auto
    (native where they serve the model and build, else torch; the reason is logged)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if backend == "torch":
        return None
    if not native.supports(mc.num_heads, mc.num_kv_heads, dtype, kv_dtype, device):
        why = (f"the native kernels serve float32 on the CPU, a float32, bfloat16 or float16 "
               f"KV cache and at most {native.MAX_GROUP} query heads per KV head, not {dtype} on "
               f"{device}, a {kv_dtype} KV cache and {mc.num_heads}/{mc.num_kv_heads}")
        if backend == "native":
            raise ValueError(f"attention backend native: {why}")
        log.info("attention_backend_torch", reason=why)
        return None
    kernels = native.load()
    if isinstance(kernels, native.BuildError):
        if backend == "native":
            raise ValueError(f"attention backend native: {kernels}")
        log.warning("attention_backend_torch", reason=str(kernels))
        return None
    return kernels


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Engine:
    """Continuous-batching generation over one model: the policy (`planner`, no torch), the
    model runner and the served weights; see the module docstring for threads."""

    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        dev = resolve_device(config.device)
        self.device = str(dev)
        # CPU steps free and reallocate megabytes of temporaries: keep them mapped
        self.retained_memory = dev.type == "cpu" and retain_freed_memory()
        self.model_config = ModelConfig.from_dir(config.model_path)
        dtype = resolve_dtype(config.dtype, self.model_config)
        self.dtype = str(dtype).removeprefix("torch.")
        self.model, _ = load_model(config.model_path, dev, dtype, config.load_format)
        mc = self.model_config
        kv_dtype = dtype if config.kv_cache_dtype == "auto" else resolve_dtype(
            config.kv_cache_dtype, mc)
        kernels = cpu_kernels(config.attention_backend, mc, dtype, kv_dtype, dev)
        packing = native_packing(kernels, dev, dtype, config.packed_weight_dtype)
        packed = (pack_linears(self.model, packing, warm_rows=config.max_batched_tokens)
                  if config.packed_cpu_linears else 0)
        if config.packed_weight_dtype != "auto" and not packed:
            raise ValueError(f"packed weight dtype {config.packed_weight_dtype}: the linears "
                             "are not packed (--no-packed-linears)")
        self.packed_linears = packed  # decoder projections served by packed weights
        # whose kernel: meshlm's, oneDNN's, or none (torch's linear)
        self.linear_kernel = "torch" if not packed else packing.name if packing else "onednn"
        self.weights = ServedWeights(self.model, config.model_path, config.load_format,
                                     self.model_config)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {mc.max_position_embeddings}"
            )
        self.vocab_size = mc.vocab_size
        self.eos_token_ids: set[int] = set(mc.eos_token_ids)
        self.kv_cache_dtype = str(kv_dtype).removeprefix("torch.")
        block_bytes = KVCache.block_bytes(mc.num_layers, config.block_size, mc.num_kv_heads,
                                          mc.head_dim, kv_dtype)
        num_blocks = self._num_blocks(block_bytes, dev)
        self.planner = BatchPlanner(
            max_running=config.max_running,
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_batched_tokens=config.max_batched_tokens,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            prefix_cache=config.enable_prefix_cache,
            can_generate=mc.has_lm_head,
        )
        self.attention_backend = "torch" if kernels is None else "native"
        # CPU seconds of the thread running each forward pass (with sampling), whichever it is:
        # beside the process's CPU, how much of it the model took (the rest is the service's).
        self.forward_cpu_seconds = 0.0
        self.runner = ModelRunner(
            self.model, config.max_running, num_blocks, config.block_size,
            tuple(sorted(self.eos_token_ids)), dev, kernels, kv_dtype,
        )
        log.info(
            "engine_ready", model_path=config.model_path, device=self.device, dtype=self.dtype,
            max_running=config.max_running, max_model_len=self.max_model_len,
            max_batched_tokens=config.max_batched_tokens, block_size=config.block_size,
            kv_blocks=num_blocks, kv_cache_gib=round(self.runner.kv.nbytes / 2**30, 3),
            kv_cache_dtype=self.kv_cache_dtype,
            threads=torch.get_num_threads(), packed_linears=packed,
            linear_kernel=self.linear_kernel,
            linear_weight_dtype=str(packing.dtype).removeprefix("torch.") if packing and packed
            else self.dtype,
            linear_activation_dtype=str(packing.activation_dtype).removeprefix("torch.")
            if packing and packed else self.dtype,
            attention_backend=self.attention_backend, fused_layers=self.runner.fused is not None,
            layers_in_one_call=self.runner.fused is not None and self.runner.fused.one_call,
            retained_memory=self.retained_memory,
        )

    def _num_blocks(self, block_bytes: int, dev: torch.device) -> int:
        """KV blocks from the configuration: a count, a byte budget, or (auto) a share of
        CUDA memory / room for max_running full sequences on CPU (capped). At least one
        full-length sequence must fit, or max_model_len is refused."""
        cfg = self.config
        per_seq = -(-self.max_model_len // cfg.block_size)
        if cfg.num_kv_blocks:
            blocks = cfg.num_kv_blocks
        elif cfg.kv_cache_bytes:
            blocks = cfg.kv_cache_bytes // block_bytes
        elif dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            # what this process's allocator caches but no tensor holds (an engine gone before
            # this one) is ours to reuse, not another's
            cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            used_by_others = total - free - cached
            blocks = int(total * cfg.mem_fraction - used_by_others) // block_bytes
        else:
            blocks = min(cfg.max_running * per_seq, CPU_KV_BYTES_CAP // block_bytes)
        if blocks < per_seq:
            raise ValueError(
                f"KV cache of {blocks} blocks x {cfg.block_size} tokens cannot hold one "
                f"sequence of max_model_len {self.max_model_len}; give it more memory or "
                "lower max_model_len"
            )
        return blocks

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    after: str | None = None, priority: int = 0, matcher: Any = None,
                    cache_salt: str = "") -> None:
        """Queue a request (loop thread). Raises ValueError if `rid` is still live. A request
        that cannot run (prompt empty, too long for max_model_len, token ids out of range,
        bad params) is not raised on: it finishes with finish_reason "error" and a message in
        the next postprocess(). `after`: the rid of a live request with the same prompt whose
        KV this one should share (n > 1); it starts once that prompt is computed. Waiting
        requests are admitted larger `priority` first, then in arrival order. `matcher`: the
        grammar's (params.grammar: `scheduler/grammar.py` builds it), fed each token drawn.
        `cache_salt`: prefix-cache reuse only among requests with the same salt."""
        self.planner.add(rid, prompt_ids, params, after, priority, matcher, cache_salt)

    def add_embed_request(self, rid: str, prompt_ids: list[int]) -> None:
        """Queue an embedding request (loop thread): its one output has `embedding`, the
        prompt's hidden states pooled as the checkpoint says (last token or mean) and
        L2-normalised; for a sequence classifier, its class logits (unnormalised) at the last
        non-pad token. Errors as for add_request."""
        mc = self.model_config
        self.planner.add_embed(rid, prompt_ids, mc.pooling, mc.pool_position(prompt_ids))

    def abort(self, rid: str) -> bool:
        """End a request at any time (loop thread); True if it was live. Its one "abort"
        output comes out of the next postprocess()/step(); no token follows it."""
        return self.planner.abort(rid)

    def abort_all(self) -> int:
        """Abort every live request; returns how many."""
        return self.planner.abort_all()

    @property
    def num_waiting(self) -> int:
        """Requests queued for a running slot (preempted and retracted ones included)."""
        return len(self.planner.waiting)

    def has_work(self) -> bool:
        """Outputs not yet returned by postprocess(), or (unless paused) anything waiting or
        running."""
        return self.planner.has_work()

    def schedule(self) -> Plan | None:
        """Pick this step's work (loop thread). None when there is nothing to run, though
        postprocess(None, None) may still have abort or error outputs to return."""
        return self.planner.schedule()

    def execute(self, plan: Plan) -> ExecResult:
        """Forward pass + sampling for `plan` (any one thread). Touches the KV cache and the
        plan's sequences only. A failure is returned, not raised: its requests then finish
        with "error"."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            items = self.runner.run(plan)
        except Exception as e:  # noqa: BLE001 - one bad batch must not kill the service
            log.exception("execute_failed", seqs=len(plan.items), tokens=plan.num_tokens)
            return ExecResult(error=f"{type(e).__name__}: {e}")
        finally:
            self.forward_cpu_seconds += time.thread_time() - cpu
        if log.debugging():  # its fields cost a pass over the plan: not for nothing
            log.debug(
                "executed", seqs=len(plan.items), tokens=plan.num_tokens,
                prefill_tokens=plan.num_prefill_tokens,
                ms=round((time.perf_counter() - start) * 1e3, 3),
            )
        return ExecResult(items=items)

    def postprocess(self, plan: Plan | None, result: ExecResult | None) -> list[StepOutput]:
        """Apply `result` (loop thread): append tokens, finish requests, free their slots, and
        return every output due, pending aborts and errors included."""
        if plan is None:
            return self.planner.postprocess(None, None)
        if result is None:
            return self.planner.postprocess(plan, None, "no result for the plan")
        return self.planner.postprocess(plan, result.items, result.error)

    def step(self) -> list[StepOutput]:
        """schedule + execute + postprocess on the calling thread."""
        plan = self.schedule()
        result = self.execute(plan) if plan is not None else None
        return self.postprocess(plan, result)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while any request is live (unless paused
        with every request retracted)."""
        return self.planner.reset_prefix_cache()

    def pause(self, mode: str) -> int:
        """Stop planning steps until resume(), treating the requests in flight as `mode` says
        ("abort" | "retract" | "in_place", see `BatchPlanner.pause`); returns how many it
        touched. Raises ValueError for another mode."""
        return self.planner.pause(mode)

    def resume(self) -> bool:
        """Plan steps again; False if the engine was not paused."""
        return self.planner.resume()

    @property
    def paused(self) -> str | None:
        """The mode of the pause in force, None while steps run."""
        return self.planner.paused

    def stats(self) -> dict[str, Any]:
        """Load figures (running, waiting, ...), totals (finished, aborted, preempted,
        retracted, generated, prompt and cached tokens, chunked prefills; the forward passes'
        CPU seconds), `paused` (the pause
        mode or None) and the KV cache's blocks (kv_block_size, kv_blocks_total/used/cached,
        kv_tokens_used; token_usage is the fraction of blocks in use)."""
        return {**self.planner.stats(), "forward_cpu_seconds_total": self.forward_cpu_seconds}

    # -- new weights (weights.py) ------------------------------------------------------------

    def check_weights(self, model_path: str, load_format: str = "auto") -> Checkpoint:
        """The checkpoint at `model_path` if this model can take its weights in place (any
        thread, no torch); see `ServedWeights.check` for the refusals."""
        return self.weights.check(model_path, load_format)

    def drop_kv(self) -> int:
        """Retract every running request and empty the prefix cache (loop thread, between
        steps); returns how many were retracted. A pause in force stays."""
        return self.planner.drop_kv()

    def load_weights(self, checkpoint: Checkpoint) -> int:
        """Copy a checked checkpoint's weights into the model in place and serve it from now
        on (engine thread, between steps, after drop_kv); returns how many tensors were stored.
        On an I/O error the served checkpoint is loaded back and WeightsLoadError raised; if
        that fails too, generation is paused (abort: no output from mixed weights) until
        another update succeeds and ContinueGeneration is called."""
        try:
            tensors = self.weights.load(checkpoint)
        except WeightsLoadError as exc:
            if not exc.restored:
                self.planner.pause("abort")
            raise
        self.config = dataclasses.replace(self.config, model_path=str(checkpoint.path),
                                          load_format=checkpoint.load_format)
        self.model_config = checkpoint.config
        return tensors

    def update_weights(self, model_path: str, load_format: str = "auto") -> WeightsUpdate:
        """check_weights, drop_kv and load_weights on the calling thread (in-process use,
        between steps)."""
        start = time.perf_counter()
        checkpoint = self.check_weights(model_path, load_format)
        retracted = self.drop_kv()
        tensors = self.load_weights(checkpoint)
        update = WeightsUpdate(str(checkpoint.path), checkpoint.load_format, retracted, tensors,
                               time.perf_counter() - start)
        log.info("weights_updated", model_path=update.model_path, load_format=update.load_format,
                 retracted=retracted, tensors=tensors, ms=round(update.seconds * 1e3, 1))
        return update
