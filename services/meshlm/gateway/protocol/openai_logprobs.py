"""Logprobs in OpenAI's shapes, from the mesh's `Logprobs` of one update (the gateway always
asks for the tokens' texts, so every entry has one).

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}, ...]}, ...], "refusal": null}; `top_logprobs` is [] when none were asked.
Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, where each position's
top_logprobs entry is {token: logprob} for the `logprobs` most likely tokens and the chosen one
(OpenAI's shape: up to logprobs + 1 entries; with `logprobs: 0`, the chosen token alone); an
echoed prompt's tokens come first, the first of them without a logprob (null, and null in
top_logprobs).

With vLLM's logprob_token_ids (`asked`) each position lists the chosen token and the asked
ids' logprobs (in the asked order) in place of the most likely ones.

vLLM's prompt_logprobs: one entry per prompt position, null at position 0, else
{"<id>": {"logprob", "rank", "decoded_token"}} for the prompt's own token (rank 1 = the most
likely) and the `prompt_logprobs` most likely ones.

With vLLM's return_tokens_as_token_ids (`as_ids`) every token is named "token_id:<id>"
instead of by its text (distinct tokens that decode alike stay apart); chat's `bytes` and
completions' `text_offset` still follow the text.

Values are float32 (numpy scalars; `dumps` writes their shortest form).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from meshlm.v1 import common_pb2

_EMPTY = common_pb2.Logprobs()


def dumps(value: Any) -> bytes:
    """JSON with numpy scalars and arrays (float32 logprobs and embeddings)."""
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def labels(texts: Sequence[str], ids: Sequence[int], as_ids: bool) -> Sequence[str]:
    """How the tokens are named: their texts, or "token_id:<id>" (`as_ids`)."""
    return [f"token_id:{t}" for t in ids] if as_ids else texts


def _entry(label: str, text: str, logprob: Any) -> dict[str, Any]:
    return {"token": label, "logprob": logprob, "bytes": list(text.encode())}


def _top(top: common_pb2.TopLogprobs, as_ids: bool) -> list[tuple[str, str, Any]]:
    """(label, text, logprob) of a position's most likely tokens."""
    values = np.asarray(top.logprobs, dtype=np.float32)
    return list(zip(labels(top.texts, top.token_ids, as_ids), top.texts, values, strict=False))


def chat_logprobs(lp: common_pb2.Logprobs | None, top: int, ids: Sequence[int] = (),
                  as_ids: bool = False, asked: bool = False) -> dict[str, Any]:
    """The logprobs of one chat choice's (or chunk's) output tokens, `ids`."""
    lp = lp or _EMPTY
    values = np.asarray(lp.output_logprobs, dtype=np.float32)
    names = labels(lp.output_texts, ids, as_ids)
    content = []
    for i, (name, text, value) in enumerate(zip(names, lp.output_texts, values, strict=False)):
        entry = _entry(name, text, value)
        if asked and i < len(lp.output_token_ids_logprobs):
            chosen = ids[i] if i < len(ids) else None
            listed = lp.output_token_ids_logprobs[i]
            entry["top_logprobs"] = [dict(entry)] + [
                _entry(*alternative) for token, alternative
                in zip(listed.token_ids, _top(listed, as_ids), strict=False) if token != chosen]
        else:
            entry["top_logprobs"] = ([_entry(*alternative) for alternative
                                      in _top(lp.output_top[i], as_ids)[:top]]
                                     if top and i < len(lp.output_top) else [])
        content.append(entry)
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """One completions choice's logprobs, built chunk by chunk: `text_offset` runs on from
    where the previous chunk ended."""

    def __init__(self, top: int, offset: int = 0, as_ids: bool = False,
                 asked: bool = False) -> None:
        self.top = top
        self.offset = offset
        self.as_ids = as_ids
        self.asked = asked  # logprob_token_ids: the asked ids' in place of the most likely

    def add(self, lp: common_pb2.Logprobs | None, echo: bool,
            ids: Sequence[int] = ()) -> dict[str, Any]:
        """The entries of one update (output tokens `ids`): the prompt's first when `echo`,
        then the output's."""
        lp = lp or _EMPTY
        tokens: list[str] = []
        texts: list[str] = []
        values: list[Any] = []
        tops: list[dict[str, Any] | None] = []
        if echo:
            self._extend(tokens, texts, values, tops, lp.input_texts, lp.input_token_ids,
                         lp.input_logprobs,
                         lp.input_token_ids_logprobs if self.asked else lp.input_top,
                         first_is_none=lp.input_start == 0)
        self._extend(tokens, texts, values, tops, lp.output_texts, ids, lp.output_logprobs,
                     lp.output_token_ids_logprobs if self.asked else lp.output_top)
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def _extend(self, tokens: list[str], texts: list[str], values: list[Any],
                tops: list[dict[str, Any] | None], new_texts: Sequence[str], ids: Sequence[int],
                logprobs: Sequence[float], top: Sequence[common_pb2.TopLogprobs],
                first_is_none: bool = False) -> None:
        array = np.asarray(logprobs, dtype=np.float32)
        names = labels(new_texts, ids, self.as_ids)
        for i, (name, value) in enumerate(zip(names, array, strict=False)):
            none = (i == 0 and first_is_none) or bool(np.isnan(value))
            tokens.append(name)
            texts.append(new_texts[i])
            values.append(None if none else value)
            if none:
                tops.append(None)
                continue
            if self.asked:  # the chosen token first, then the asked ids'
                alternatives = {name: value}
                for label, _, v in (_top(top[i], self.as_ids) if i < len(top) else []):
                    alternatives.setdefault(label, v)
            else:
                alternatives = ({label: v for label, _, v in _top(top[i], self.as_ids)[:self.top]}
                                if self.top and i < len(top) else {})
                alternatives.setdefault(name, value)  # the chosen token, when not among them
            tops.append(alternatives)


def prompt_logprobs(lp: common_pb2.Logprobs | None, k: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs of one prompt (its logprobs from position 0): per position, the
    prompt token's logprob and rank and the `k` most likely tokens' (null at position 0)."""
    lp = lp or _EMPTY
    values = np.asarray(lp.input_logprobs, dtype=np.float32)
    out: list[dict[str, Any] | None] = []
    for i, (token, text, value) in enumerate(zip(lp.input_token_ids, lp.input_texts, values,
                                                 strict=False)):
        if (i == 0 and lp.input_start == 0) or np.isnan(value):
            out.append(None)
            continue
        rank = lp.input_ranks[i] if i < len(lp.input_ranks) else None
        entry = {str(token): {"logprob": value, "rank": rank, "decoded_token": text}}
        if k and i < len(lp.input_top):
            best = lp.input_top[i]
            for place, (t, v, txt) in enumerate(zip(best.token_ids[:k], best.logprobs,
                                                   best.texts, strict=False)):
                entry.setdefault(str(t), {"logprob": np.float32(v), "rank": place + 1,
                                          "decoded_token": txt})
        out.append(entry)
    return out
