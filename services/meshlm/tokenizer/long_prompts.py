"""Long prompts, counted piece by piece: one that cannot fit the context is refused without
encoding all of it (the `tokenizers` library cannot stop an encoding part-way, and an encoding
holds about a hundred bytes per character while it runs).

A text longer than `piece_chars` is cut into pieces of about that size, each cut at the start of
a run of whitespace (where pre-tokenizers split anyway) when the piece has one. The pieces'
token counts add up to about the text's; a cut can change the count by a few tokens, so each
cut takes SLACK_PER_CUT off the sum. That estimate errs low: a text it puts over the limit is
over, and counting stops there, so memory stays at one piece's. A text that passes is encoded
whole, for its exact ids. Pure functions; they run on the tokenizer's worker threads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from meshlm.common.context_length import prompt_too_long
from meshlm.tokenizer.tokenization import TextTokenizer

PIECE_CHARS = 1 << 16
SLACK_PER_CUT = 4  # tokens a cut may add (a word or a whitespace run split in two)
_LOOK_BACK = 1024  # characters searched for whitespace before a cut


@dataclass(frozen=True)
class TooLong:
    """A prompt refused before it was encoded whole: it has more than `tokens` tokens."""

    tokens: int
    chars: int

    def message(self, max_model_len: int, prompt_field: str = "text") -> str:
        return prompt_too_long(prompt_field, f"more than {self.tokens} ({self.chars} characters)",
                               max_model_len)


Encoded = list[int] | TooLong


def encode_prompts(tok: TextTokenizer, texts: Sequence[str | tuple[str, str]],
                   add_special_tokens: bool, max_tokens: int,
                   piece_chars: int = PIECE_CHARS) -> list[Encoded]:
    """Each text's ids (`encode_batch`, in one call), or TooLong for one that has more than
    `max_tokens` tokens by the piecewise count."""
    out: list[Encoded | None] = [count_over(tok, t, max_tokens, piece_chars) for t in texts]
    todo = [i for i, o in enumerate(out) if o is None]
    if todo:
        encoded = tok.encode_batch([texts[i] for i in todo], add_special_tokens)
        for i, ids in zip(todo, encoded, strict=True):
            out[i] = ids
    return [o for o in out if o is not None]


def count_over(tok: TextTokenizer, text: str | tuple[str, str], max_tokens: int,
               piece_chars: int = PIECE_CHARS) -> TooLong | None:
    """TooLong if the text (or pair) has more than `max_tokens` tokens by the piecewise count;
    None when it may fit, and always for a text of one piece (encode it whole instead)."""
    parts = text if isinstance(text, tuple) else (text,)
    chars = sum(len(p) for p in parts)
    if chars <= piece_chars:
        return None
    estimate = 0
    for part in parts:
        for i, piece in enumerate(pieces(part, piece_chars)):
            estimate += tok.count(piece) - (SLACK_PER_CUT if i else 0)
            if estimate > max_tokens:
                return TooLong(tokens=estimate, chars=chars)
    return None


def pieces(text: str, size: int) -> Iterator[str]:
    """`text` in consecutive pieces of at most `size` characters (the last one may be shorter),
    cut before whitespace where there is some."""
    start = 0
    while len(text) - start > size:
        cut = _cut(text, start, start + size)
        yield text[start:cut]
        start = cut
    yield text[start:]


def _cut(text: str, start: int, end: int) -> int:
    """Where to end the piece text[start:end]: the start of the last whitespace run that
    begins in its last _LOOK_BACK characters, else `end`."""
    floor = max(start + 1, end - _LOOK_BACK)
    i = end
    while i > floor and not (text[i].isspace() and not text[i - 1].isspace()):
        i -= 1
    return i if i > floor else end
