"""Engine: the public surface of the inference engine (policy + model runner).

A step is three calls, split so that a server can run the forward pass off its event loop:

    plan = engine.schedule()                                  # loop thread
    result = engine.execute(plan) if plan else None           # executor thread
    outputs = engine.postprocess(plan, result)                # loop thread

`add_request`, `abort`, `schedule`, `postprocess` and `stats` belong to one thread (the loop);
`execute` may run concurrently with `add_request` and `abort`, never with `schedule` or
`postprocess`, and at most one plan is in flight. `step()` chains the three for in-process use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from meshlm.common.logs import get_logger
from meshlm.scheduler.engine.model_runner import ModelRunner
from meshlm.scheduler.engine.policy import Scheduler
from meshlm.scheduler.engine.sequence import ExecResult, Plan, SamplingParams, StepOutput
from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.loader import load_model, resolve_dtype

__all__ = ["Engine", "EngineConfig", "ExecResult", "Plan", "SamplingParams", "StepOutput"]

log = get_logger(__name__)


@dataclass
class EngineConfig:
    """What the engine serves and how much it may hold at once."""

    model_path: str
    device: str = "auto"  # "auto" = cuda if available else cpu
    dtype: str = "auto"  # auto = config.json torch_dtype, else float32
    max_running: int = 64  # KV slots
    max_prefill_tokens: int = 4096
    max_model_len: int | None = None  # default: config max_position_embeddings (see Engine)
    load_format: str = "auto"  # auto = the safetensors; dummy = seeded random weights
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Engine:
    """Continuous-batching generation over one model; see the module docstring for threads."""

    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        dev = resolve_device(config.device)
        self.device = str(dev)
        self.model_config = ModelConfig.from_dir(config.model_path)
        dtype = resolve_dtype(config.dtype, self.model_config)
        self.dtype = str(dtype).removeprefix("torch.")
        self.model, _ = load_model(config.model_path, dev, dtype, config.load_format)
        mc = self.model_config
        limit, why = mc.max_position_embeddings, "max_position_embeddings"
        if mc.sliding_window is not None and mc.sliding_window < limit:
            # The KV-cache attention applies no sliding window: serve only lengths it never cuts.
            limit, why = mc.sliding_window, "sliding_window (not applied by the KV cache)"
            if config.max_model_len is None:
                log.warning(
                    "max_model_len_capped_at_sliding_window", sliding_window=mc.sliding_window,
                    max_position_embeddings=mc.max_position_embeddings,
                )
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's {why} {limit}"
            )
        self.vocab_size = mc.vocab_size
        self.eos_token_ids: set[int] = set(mc.eos_token_ids)
        self.scheduler = Scheduler(
            max_running=config.max_running,
            max_model_len=self.max_model_len,
            max_prefill_tokens=config.max_prefill_tokens,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
        )
        self.runner = ModelRunner(
            self.model, config.max_running, self.max_model_len,
            tuple(sorted(self.eos_token_ids)), dev,
        )
        log.info(
            "engine_ready", model_path=config.model_path, device=self.device, dtype=self.dtype,
            max_running=config.max_running, max_model_len=self.max_model_len,
            kv_cache_gib=round(self.runner.kv.nbytes / 2**30, 3),
            threads=torch.get_num_threads(),
        )

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request (loop thread). Raises ValueError if `rid` is still live. A request
        that cannot run (prompt empty, too long for max_model_len, token ids out of range,
        bad params) is not raised on: it finishes with finish_reason "error" and a message in
        the next postprocess()."""
        self.scheduler.add(rid, prompt_ids, params)

    def abort(self, rid: str) -> bool:
        """End a request at any time (loop thread); True if it was live. Its one "abort"
        output comes out of the next postprocess()/step(); no token follows it."""
        return self.scheduler.abort(rid)

    def abort_all(self) -> int:
        """Abort every live request; returns how many."""
        return self.scheduler.abort_all()

    def has_work(self) -> bool:
        """Anything waiting, running, or outputs not yet returned by postprocess()."""
        return self.scheduler.has_work()

    def schedule(self) -> Plan | None:
        """Pick this step's work (loop thread). None when there is nothing to run, though
        postprocess(None, None) may still have abort or error outputs to return."""
        return self.scheduler.schedule()

    def execute(self, plan: Plan) -> ExecResult:
        """Forward pass + sampling for `plan` (any one thread). Touches the KV cache and the
        plan's sequences only. A failure is returned, not raised: its requests then finish
        with "error"."""
        start = time.perf_counter()
        try:
            tokens = self.runner.run(plan)
        except Exception as e:  # noqa: BLE001 - one bad batch must not kill the service
            log.exception("execute_failed", prefill=plan.is_prefill, seqs=len(plan.seqs))
            return ExecResult(error=f"{type(e).__name__}: {e}")
        log.debug(
            "executed", prefill=plan.is_prefill, seqs=len(plan.seqs), tokens=plan.num_tokens,
            ms=round((time.perf_counter() - start) * 1e3, 3),
        )
        return ExecResult(token_ids=tokens)

    def postprocess(self, plan: Plan | None, result: ExecResult | None) -> list[StepOutput]:
        """Apply `result` (loop thread): append tokens, finish requests, free their slots, and
        return every output due, pending aborts and errors included."""
        if plan is None:
            return self.scheduler.postprocess(None, None)
        if result is None:
            return self.scheduler.postprocess(plan, None, "no result for the plan")
        return self.scheduler.postprocess(plan, result.token_ids, result.error)

    def step(self) -> list[StepOutput]:
        """schedule + execute + postprocess on the calling thread."""
        plan = self.schedule()
        result = self.execute(plan) if plan is not None else None
        return self.postprocess(plan, result)

    def stats(self) -> dict[str, Any]:
        """running, waiting, max_running, free_slots, finished_total (all ends), aborted_total,
        generated_tokens_total, token_usage (fraction of KV slot-tokens in use)."""
        return self.scheduler.stats()
