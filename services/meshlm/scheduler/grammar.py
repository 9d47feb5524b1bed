"""Constrained decoding's matchers: each constrained request's grammar (an llguidance grammar
the gateway built from a JSON schema, a regex, an EBNF grammar or a choice) becomes an
llguidance `LLMatcher` over the checkpoint's tokenizer, before the request is queued.

Building runs on a worker thread (`asyncio.to_thread`; llguidance releases the GIL while it
compiles), never on the event loop or the engine thread: a large schema takes milliseconds to
build, a pathological one is cut short by llguidance's own limits. The tokenizer's token
table is built once, at the first constrained request (about 10 ms for 2k tokens, a second
for 150k). The engine then uses a matcher through three methods (`engine/grammar.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import llguidance


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
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            out.append(matcher.get_error() if matcher.is_error() else matcher)
        return out

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_path.read_text(), n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None)
            return self._tokenizer
