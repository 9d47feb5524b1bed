"""The words for a request that does not fit the model's context length, the same from the
gateway (token-id prompts) and the tokenizer (text prompts). They carry the phrases SGLang's
and vLLM's clients and tests look for: a prompt "is longer than the model's context length";
a completion that cannot fit "is too large", its "Requested token count exceeds the model's
maximum context length". And how a prompt is cut to fit when the client asks for it (vLLM's
truncate_prompt_tokens), the same in both."""

from __future__ import annotations

MAX_NEW_TOKENS = "sampling_params.max_new_tokens"


def prompt_too_long(field: str, tokens: int | str, limit: int) -> str:
    """`field`'s prompt of `tokens` tokens (a count, or "more than N") leaves no room."""
    return (f"{field}: the prompt is {tokens} tokens, which is longer than the model's context "
            f"length ({limit} tokens); shorten the prompt")


def truncated(ids: list[int], keep: int, first: bool = False) -> list[int]:
    """`ids` cut to `keep` (0: not cut): the last ones, as vLLM cuts by default, or the first
    ones (`first`, vLLM's truncation_side "right")."""
    if not keep or len(ids) <= keep:
        return ids
    return ids[:keep] if first else ids[-keep:]


def completion_too_long(prompt_tokens: int, max_new_tokens: int, limit: int) -> str:
    """max_new_tokens does not fit beside a prompt that does."""
    room = limit - prompt_tokens
    return (f"{MAX_NEW_TOKENS}: max_new_tokens is too large: {max_new_tokens}. Requested token "
            f"count exceeds the model's maximum context length of {limit} tokens "
            f"({prompt_tokens} prompt + {max_new_tokens} completion tokens); use at most {room}")
