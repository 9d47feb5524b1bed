"""Long prompts counted piece by piece: the cuts, an estimate that errs low, and refusal of a
prompt that cannot fit without encoding all of it."""

from __future__ import annotations

import random

import pytest

from meshlm.common.default_model import ensure_default_model
from meshlm.tokenizer.long_prompts import TooLong, count_over, encode_prompts, pieces
from meshlm.tokenizer.tokenization import TextTokenizer

PIECE = 4096


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_pretrained(ensure_default_model())


def _texts() -> dict[str, str]:
    rng = random.Random(7)
    words = ["the", "model", "reads", "tokens,", "and", "writes", "text.", "\n\n", "    "]
    return {
        "prose": " ".join(rng.choice(words) for _ in range(20_000)),
        "whitespace runs": "a" + " " * 5000 + "b\t\t\n" * 3000,
        "no whitespace": "日本語のテキスト" * 3000,
        "symbols": "".join(chr(rng.randrange(33, 0x2FFF)) for _ in range(30_000)),
    }


@pytest.mark.parametrize("name", list(_texts()))
def test_pieces_cover_the_text_in_order(name: str) -> None:
    text = _texts()[name]
    parts = list(pieces(text, PIECE))
    assert "".join(parts) == text
    assert all(0 < len(p) <= PIECE for p in parts)
    if name == "prose":  # cut before whitespace where there is some
        assert all(p[0].isspace() for p in parts[1:])


def test_a_short_text_is_one_piece() -> None:
    assert list(pieces("short", PIECE)) == ["short"]


@pytest.mark.parametrize("name", list(_texts()))
def test_the_estimate_errs_low(tok: TextTokenizer, name: str) -> None:
    text = _texts()[name]
    exact = len(tok.encode(text, add_special_tokens=False))
    over = count_over(tok, text, max_tokens=0, piece_chars=PIECE)
    assert over is not None and over.chars == len(text)
    # counting stops as soon as the estimate passes the limit: run it to the end instead
    full = count_over(tok, text, max_tokens=exact - 1, piece_chars=PIECE)
    assert full is None or full.tokens <= exact


def test_a_text_that_cannot_fit_is_refused_after_a_piece(tok: TextTokenizer) -> None:
    text = _texts()["prose"] * 50  # ~5 M characters
    over = count_over(tok, text, max_tokens=2047, piece_chars=1 << 16)
    assert over is not None and 2047 < over.tokens < 2 * (1 << 16)
    assert over.message(2048).startswith("text: the prompt is more than")
    assert "is longer than the model's context length (2048 tokens)" in over.message(2048)


def test_a_text_that_may_fit_is_encoded_whole(tok: TextTokenizer) -> None:
    text = _texts()["prose"]
    assert count_over(tok, text, max_tokens=10**6, piece_chars=PIECE) is None
    assert count_over(tok, text[:PIECE], max_tokens=0, piece_chars=PIECE) is None  # one piece


def test_encode_prompts_mixes_ids_and_refusals(tok: TextTokenizer) -> None:
    long = _texts()["prose"]
    texts: list[str | tuple[str, str]] = ["hello world", long, ("query", "document")]
    out = encode_prompts(tok, texts, True, max_tokens=2047, piece_chars=PIECE)
    assert out[0] == tok.encode("hello world")
    assert isinstance(out[1], TooLong)
    assert out[2] == tok.encode_batch([("query", "document")])[0]
