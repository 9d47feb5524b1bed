"""Texts of single tokens, for logprob entries (return_text_in_logprobs).

A token's text is `decode([id])` with special tokens kept, as SGLang's `batch_decode` gives it
(so a byte-level token that is part of a character reads as U+FFFD). Texts are cached by id:
the cache is bounded by the vocabulary, and a batch's unseen ids are decoded in one call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

from meshlm.v1 import common_pb2


class TokenTexts:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def learn(self, ids: Iterable[int]) -> None:
        """Decode the ids not seen yet, all in one call."""
        cache = self._cache
        missing = list({i for i in ids if i not in cache})
        if missing:
            texts = self._tokenizer.decode_batch([[i] for i in missing],
                                                 skip_special_tokens=False)
            cache.update(zip(missing, texts, strict=True))

    def fill(self, items: Sequence[tuple[Sequence[int], common_pb2.Logprobs]]) -> None:
        """Add the texts of every entry of each (output token ids, logprobs) pair: the output
        tokens', the prompt tokens', every top alternative's and every asked id's
        (token_ids_logprob); their texts must be empty."""
        self.learn(i for ids, lp in items for i in _ids(ids, lp))
        text = self._cache.__getitem__
        for ids, lp in items:
            lp.output_texts.extend(text(i) for i in ids[: len(lp.output_logprobs)])
            lp.input_texts.extend(text(i) for i in lp.input_token_ids)
            for top in _tops(lp):
                top.texts.extend(text(i) for i in top.token_ids)


def _tops(lp: common_pb2.Logprobs) -> tuple[common_pb2.TopLogprobs, ...]:
    return (*lp.output_top, *lp.input_top, *lp.output_token_ids_logprobs,
            *lp.input_token_ids_logprobs)


def _ids(output_ids: Sequence[int], lp: common_pb2.Logprobs) -> Iterable[int]:
    yield from output_ids[: len(lp.output_logprobs)]
    yield from lp.input_token_ids
    for top in _tops(lp):
        yield from top.token_ids
