"""The bytes each token stands for under a ByteLevel decoder (GPT-2, Llama-3, Qwen), so that a
request's text can be decoded a token at a time by table lookup (incremental.py).

A byte-level BPE spells every byte as one printable character (GPT-2's byte-to-unicode table:
the printable bytes as themselves, the rest as the characters from U+0100 on). Its decoder maps
each character of each token back to its byte (a token with a character outside the table
stands for its own UTF-8 bytes) and decodes the concatenation as UTF-8, with U+FFFD for what is
not valid. So a token's bytes do not depend on its neighbours, and the text of a sequence is
the incremental UTF-8 decoding of its tokens' bytes.

`ByteLevelTable.check` compares this with the tokenizer's own decode on the added tokens and a
spread of the vocabulary; a tokenizer where they differ keeps the Rust DecodeStream.
"""

from __future__ import annotations

from tokenizers import Tokenizer


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_of_char()


class ByteLevelTable:
    """Token id -> bytes for one tokenizer and one skip_special_tokens setting, filled as ids
    are first seen (at most the vocabulary). `text` holds the ids whose bytes are complete,
    valid UTF-8 on their own: the common case, where a token's text is one lookup."""

    def __init__(self, tokenizer: Tokenizer, skipped: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._skipped = skipped  # special ids that skip_special_tokens drops
        self._bytes: dict[int, bytes] = {}
        self.text: dict[int, str] = {}

    def bytes_of(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is not None:
            return found
        raw = b"" if token_id in self._skipped else self._spell(token_id)
        self._bytes[token_id] = raw
        try:
            self.text[token_id] = raw.decode("utf-8")
        except UnicodeDecodeError:
            pass  # part of a character, or invalid: the request's UTF-8 decoder sorts it out
        return raw

    def _spell(self, token_id: int) -> bytes:
        token = self._tokenizer.id_to_token(token_id)
        if token is None:  # beyond the vocabulary (a padded embedding): decode drops it
            return b""
        try:
            return bytes([_BYTE_OF_CHAR[c] for c in token])
        except KeyError:
            return token.encode()

    def check(self, samples: int = 512) -> bool:
        """Whether each added token and a spread of `samples` vocabulary ids decode as the
        tokenizer decodes them alone."""
        vocab = self._tokenizer.get_vocab_size()
        ids = {*self._tokenizer.get_added_tokens_decoder(),
               *range(0, vocab, max(1, vocab // samples))}
        skip = bool(self._skipped)
        return all(self.bytes_of(i).decode("utf-8", "replace")
                   == self._tokenizer.decode([i], skip_special_tokens=skip) for i in ids)
