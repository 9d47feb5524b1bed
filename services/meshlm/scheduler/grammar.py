"""Constrained decoding's matchers: each constrained request's grammar (an llguidance grammar
the gateway built from a JSON schema, a regex, an EBNF grammar or a choice) becomes an
llguidance `LLMatcher` over the checkpoint's tokenizer, before the request is queued.

Building runs on a worker thread (`asyncio.to_thread`; llguidance releases the GIL while it
compiles), never on the event loop or the engine thread, and so does each matcher's first
mask: a large schema takes milliseconds to build, a pathological one is cut short by
llguidance's own limits (a grammar that fails already there is refused before it is
queued). The tokenizer's token table is built once, at the first constrained request (about
10 ms for 2k tokens, a second for 150k). The engine then uses a matcher through three
methods (`engine/grammar.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import llguidance

# llguidance's own bounds, but for the alternatives one grammar row may hold: 10,000 instead
# of 2,000, so that an object schema of up to about 2,500 optional properties can be followed
# (each of its steps still bounded by the Earley items and lexer fuel a step may use: a
# 1,000-property schema's steps took 0.7 ms at most).
# Its errors in one line, without the parser's state (which names the grammar's insides).
LIMITS = llguidance.LLParserLimits(max_items_in_row=10_000, verbose_errors=False)


class Grammars:
    """Matchers for one checkpoint's tokenizer (`model_path`/tokenizer.json), whose logits have
    `vocab_size` ids and which ends on `eos_token_ids`."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer_path = Path(model_path) / "tokenizer.json"
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def build(self, grammars: list[str]) -> list[Any]:
        """Each grammar's matcher, or (a str) why it cannot constrain this tokenizer's output.
        Blocking: call it on a worker thread."""
        try:
            tokenizer = self._llg_tokenizer()
        except (OSError, ValueError) as exc:
            return [f"constrained decoding needs the checkpoint's tokenizer.json ({exc})"] * len(
                grammars)
        out: list[Any] = []
        for grammar in grammars:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
            out.append(_probed(matcher))
        return out

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_path.read_text(), n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None)
            return self._tokenizer


def _probed(matcher: Any) -> Any:
    """`matcher`, or why it cannot go far. Its first mask is computed here, not on the engine
    thread: it is the dearest (a schema of 5,000 properties: 0.1 s), and the matcher keeps it
    for the first step. A copy then takes the tokens the grammar forces at the start (an
    object's "{") and computes the mask after them, so a grammar past llguidance's bounds
    there (too many alternatives in a row) is refused before it is queued, not a step in."""
    if matcher.is_error():
        return _said(matcher.get_error())
    matcher.compute_bitmask()
    probe = matcher.deep_copy()
    forced = probe.compute_ff_tokens()
    if forced and probe.consume_tokens(forced):
        probe.compute_bitmask()
    for m in (matcher, probe):
        if m.is_error():
            return _said(m.get_error())
    return matcher


def _said(error: str) -> str:
    """llguidance's error in one line, without its marker of the state it leaves out."""
    lines = [line.strip() for line in error.splitlines()]
    return "; ".join(line for line in lines if line and line != "<non-verbose/>")
