"""The logprob options of a generation request (TextGenerate, Generate, SGLang's /generate):
return_logprob, top_logprobs_num, logprob_start_len, return_text_in_logprobs and meshlm's
token_ids_logprob (SGLang's native field). Request-level in the public API; internally they
ride in the sampling params, set only when return_logprob was asked, so that the engine never
sees stray values. Pure: no I/O.

token_ids_logprob asks for the logprobs of given token ids at every output position, and at
the prompt positions from logprob_start_len; it is ignored without return_logprob, as SGLang
ignores it (its ids are checked against the vocabulary all the same, by the caller:
`validation.check_token_ids`). With max_new_tokens 0 (a prefill-only request) the output
positions are the one after the prompt.
"""

from __future__ import annotations

from meshlm.common.errors import invalid
from meshlm.v1 import common_pb2
from sglang.runtime.v1 import sglang_pb2

MAX_TOP_LOGPROBS = 20

GenerateLike = sglang_pb2.TextGenerateRequest | sglang_pb2.GenerateRequest


def logprob_options(
    req: GenerateLike, sampling: common_pb2.SamplingParams, prompt_tokens: int | None
) -> None:
    """Check the logprob options and copy them into `sampling` when return_logprob is asked.

    Ranges are checked even when return_logprob is off (then the options are ignored).
    `prompt_tokens` is None for text prompts: the tokenizer checks logprob_start_len.
    """
    top = req.top_logprobs_num
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs_num", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    start = req.logprob_start_len if req.HasField("logprob_start_len") else -1
    if start < -1:
        raise invalid("logprob_start_len",
                      f"must be -1 (no prompt logprobs) or a prompt position >= 0, got {start}")
    if not req.return_logprob:
        sampling.logprob_start_len = -1
        return
    if prompt_tokens is not None and start >= prompt_tokens:
        raise invalid("logprob_start_len",
                      f"must be less than the prompt's length ({prompt_tokens} tokens), "
                      f"got {start}")
    sampling.return_logprob = True
    sampling.top_logprobs_num = top
    sampling.logprob_start_len = start
    sampling.return_text_in_logprobs = req.return_text_in_logprobs
    sampling.token_ids_logprob.extend(req.token_ids_logprob)
