"""Wire <-> engine conversion for the scheduler (the one place it happens)."""

from __future__ import annotations

from meshlm.scheduler.engine.engine import SamplingParams
from meshlm.v1 import common_pb2


def engine_params(p: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty, max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens, stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos, seed=p.seed if p.HasField("seed") else None,
    )
