"""Wire conversion for the tokenizer (the one place it happens): what a gateway's GenerateRequest
asks to have tokenized, and what answers it: the scheduler's TokenizedRequest (the gateway's
RequestMeta forwarded whole, with the prompt's ids and this hop's trace context added) or a
Rejection back to the gateway."""

from __future__ import annotations

import grpc

from meshlm.common import context_length
from meshlm.v1 import common_pb2, scheduler_pb2, tokenizer_pb2


def prompt_chars(req: tokenizer_pb2.GenerateRequest) -> int:
    """The characters to tokenize (text and text pair; a chat's messages as JSON); 0 for a
    prompt given as ids."""
    kind = req.WhichOneof("prompt")
    if kind == "chat":
        return len(req.chat.messages_json)
    return len(req.text) + len(req.text_pair) if kind == "text" else 0


def prompt_text(req: tokenizer_pb2.GenerateRequest) -> str | tuple[str, str]:
    """A text request's text, or its (text, text_pair) pair (cross-encoder input)."""
    return (req.text, req.text_pair) if req.text_pair else req.text


def truncated(req: tokenizer_pb2.GenerateRequest, ids: list[int]) -> list[int]:
    """`ids` cut as the client asked (truncate_prompt_tokens): the last ones kept, or the
    first ones (truncate_right)."""
    return context_length.truncated(ids, req.truncate_prompt_tokens, req.truncate_right)


def tokenized(req: tokenizer_pb2.GenerateRequest, ids: list[int], trace: dict[str, str],
              bad_words: list[list[int]] | None = None,
              thinking: list[list[int]] | None = None) -> scheduler_pb2.TokenizedRequest:
    """`req` for its scheduler: its meta as the gateway built it, the prompt's `ids`, the W3C
    context of this hop's span (`trace`), its bad_words and its thinking budget's tags
    (opening, closing) encoded."""
    out = scheduler_pb2.TokenizedRequest(meta=req.meta, input_ids=ids, trace=trace)
    for word in bad_words or ():
        out.bad_words.add(ids=word)
    if thinking is not None:
        out.thinking_open.ids[:], out.thinking_close.ids[:] = thinking
    return out


def rejection(rid: str, code: grpc.StatusCode, message: str) -> tokenizer_pb2.Rejection:
    return tokenizer_pb2.Rejection(rid=rid, status=common_pb2.Status(code=code.value[0],
                                                                     message=message))


def min_over_max(sampling: common_pb2.SamplingParams) -> str | None:
    """The gateway's check of min_new_tokens, again once the tokenizer set max_new_tokens (a
    chat's default, the room its prompt leaves): the same message."""
    if sampling.min_new_tokens <= sampling.max_new_tokens:
        return None
    return (f"sampling_params.min_new_tokens: must be in [0, max_new_tokens="
            f"{sampling.max_new_tokens}], got {sampling.min_new_tokens}")
