"""What the detokenizer keeps per request between its outputs."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

from meshlm.detokenizer.incremental import IncrementalDetokenizer


@dataclass
class DecodeState:
    """Per-request state: where its text goes and how it is decoded."""

    gateway: str
    scheduler: str
    decoder: IncrementalDetokenizer | None  # None: token ids only (Generate)
    span: trace.Span
    logprob_texts: bool = False  # return_text_in_logprobs
    stop_token_text: bool = False  # no_stop_trim: the matched stop token's text is kept
