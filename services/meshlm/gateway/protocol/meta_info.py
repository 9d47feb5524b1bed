"""The meta_info map a public response carries: ids, token counts, logprobs when asked, and
the finish reason, matched stop and end-to-end latency on a sample's last message."""

from __future__ import annotations

import time

from meshlm.gateway.mesh.inbox import Update
from meshlm.gateway.protocol.choices import Child
from meshlm.gateway.protocol.logprob_meta import logprob_meta
from meshlm.gateway.protocol.validation import ValidatedRequest


def meta_info(v: ValidatedRequest, child: Child, update: Update,
              started: float) -> dict[str, str]:
    """For `update` of sample `child` of `v`, which arrived at `started` (unix seconds)."""
    meta = running_meta(child.rid, update.prompt_tokens, update.completion_tokens,
                        update.cached_tokens)
    if v.n > 1:
        meta["index"] = str(child.index)
    if v.embed:
        del meta["completion_tokens"]
    sampling = v.sampling
    if sampling.return_logprob:
        meta.update(logprob_meta(update.token_ids, update.logprobs,
                                 top=sampling.top_logprobs_num > 0,
                                 text=sampling.return_text_in_logprobs,
                                 asked=bool(sampling.token_ids_logprob)))
    final = update.final
    if final is not None:
        meta["finish_reason"] = final.finish_reason
        matched = final.WhichOneof("matched")
        if matched == "matched_token":
            meta["matched_stop"] = str(final.matched_token)
            meta["matched_stop_type"] = "token"
        elif matched == "matched_text":
            meta["matched_stop"] = final.matched_text
            meta["matched_stop_type"] = "text"
        meta["e2e_latency"] = f"{time.time() - started:.6f}"
    return meta


def running_meta(rid: str, prompt: int, completion: int, cached: int) -> dict[str, str]:
    """The meta_info of a running output of a one-sample request without logprobs."""
    return {"id": rid, "prompt_tokens": str(prompt), "completion_tokens": str(completion),
            "cached_tokens": str(cached)}
