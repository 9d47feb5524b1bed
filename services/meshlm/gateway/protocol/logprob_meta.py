"""Logprobs in meta_info, in SGLang's shapes (values are JSON text, as meta_info is a string map):

    output_token_logprobs      [[logprob, token_id, text | null], ...]      one per output token
    output_top_logprobs        [[[logprob, token_id, text | null], ...], ...] per output token
    output_token_ids_logprobs  the same shape: the asked ids (token_ids_logprob) in asked order
    input_token_logprobs       the same for prompt positions [logprob_start_len, prompt length);
    input_top_logprobs         prompt position 0 has no logprob: null (and null lists)
    input_token_ids_logprobs

The text is the token's own text when return_text_in_logprobs was asked, else null. The top
keys are present only when top_logprobs_num > 0, the token_ids keys only when token_ids_logprob
was given (as in SGLang). A streamed message carries the entries of its own tokens (the
prompt's with the first tokens), so that concatenating the messages' lists gives the whole, as
with output_ids. A prefill-only request (max_new_tokens 0) has no output token, but its
output top and token_ids lists hold the one position after the prompt.

Logprobs are float32: they are written in float32's shortest form (-0.1, not -0.10000000149).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from meshlm.v1 import common_pb2

OUTPUT_TOKEN_LOGPROBS = "output_token_logprobs"
OUTPUT_TOP_LOGPROBS = "output_top_logprobs"
INPUT_TOKEN_LOGPROBS = "input_token_logprobs"
INPUT_TOP_LOGPROBS = "input_top_logprobs"
OUTPUT_TOKEN_IDS_LOGPROBS = "output_token_ids_logprobs"
INPUT_TOKEN_IDS_LOGPROBS = "input_token_ids_logprobs"
LOGPROB_KEYS = (INPUT_TOKEN_LOGPROBS, OUTPUT_TOKEN_LOGPROBS, INPUT_TOP_LOGPROBS,
                OUTPUT_TOP_LOGPROBS, INPUT_TOKEN_IDS_LOGPROBS, OUTPUT_TOKEN_IDS_LOGPROBS)

Entry = list[Any]  # [logprob | None, token_id, text | None]
_EMPTY = common_pb2.Logprobs()


def logprob_meta(token_ids: Sequence[int], lp: common_pb2.Logprobs | None, *, top: bool,
                 text: bool, asked: bool = False) -> dict[str, str]:
    """meta_info entries for one message: `token_ids` are its output tokens, `lp` what arrived
    with them (None: nothing did). `top`: top_logprobs_num > 0; `text`: return_text_in_logprobs;
    `asked`: token_ids_logprob was given.
    """
    lp = lp or _EMPTY
    # The first prompt position has no logprob (nothing precedes it).
    first_has_none = lp.input_start == 0
    meta = {
        OUTPUT_TOKEN_LOGPROBS: _dumps(_entries(
            lp.output_logprobs, token_ids, lp.output_texts if text else None)),
        INPUT_TOKEN_LOGPROBS: _dumps(_entries(
            lp.input_logprobs, lp.input_token_ids, lp.input_texts if text else None,
            first_has_none=first_has_none)),
    }
    if top:
        meta[OUTPUT_TOP_LOGPROBS] = _dumps([_top(t, text) for t in lp.output_top])
        meta[INPUT_TOP_LOGPROBS] = _dumps(_input_tops(lp.input_top, text, first_has_none))
    if asked:
        meta[OUTPUT_TOKEN_IDS_LOGPROBS] = _dumps(
            [_top(t, text) for t in lp.output_token_ids_logprobs])
        meta[INPUT_TOKEN_IDS_LOGPROBS] = _dumps(
            _input_tops(lp.input_token_ids_logprobs, text, first_has_none))
    return meta


def _input_tops(tops: Sequence[common_pb2.TopLogprobs], text: bool,
                first_has_none: bool) -> list[list[Entry] | None]:
    return [None if i == 0 and first_has_none else _top(t, text) for i, t in enumerate(tops)]


def _entries(logprobs: Sequence[float], ids: Sequence[int], texts: Sequence[str] | None,
             *, first_has_none: bool = False) -> list[Entry]:
    values = np.asarray(logprobs, dtype=np.float32)
    out: list[Entry] = []
    for i, (value, token_id) in enumerate(zip(values, ids, strict=False)):
        none = math.isnan(value) or (i == 0 and first_has_none)
        out.append([None if none else value, token_id,
                    texts[i] if texts is not None and i < len(texts) else None])
    return out


def _top(top: common_pb2.TopLogprobs, text: bool) -> list[Entry]:
    return _entries(top.logprobs, top.token_ids, top.texts if text else None)


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode()
