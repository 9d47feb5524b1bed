"""Incremental detokenizers: the streamed text always equals the full decode, cut at a stop."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from meshlm.common.default_corpus import CORPUS
from meshlm.common.default_model import build_tokenizer
from meshlm.detokenizer.incremental import (
    ByteLevelDetokenizer,
    DecodeStreamDetokenizer,
    IncrementalDetokenizer,
    OffsetDetokenizer,
    make_detokenizer,
)

# -- tokenizers of each decoder family ----------------------------------------------------------


@functools.cache
def default_tokenizer() -> Tokenizer:
    """The default model's byte-level BPE, as saved in its tokenizer.json."""
    return Tokenizer.from_str(build_tokenizer().to_str())


@functools.cache
def llama2_tokenizer() -> Tokenizer:
    """SentencePiece-style BPE with <0xNN> byte fallback, decoded as Llama-2's tokenizer.json."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    base.train_from_iterator(CORPUS.split("\n\n"), trainer)
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = base.normalizer
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


@functools.cache
def metaspace_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer)
    return tok


@functools.cache
def wordpiece_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=True)
    trainer = trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer)
    return tok


TOKENIZERS = {
    "bytelevel": default_tokenizer,
    "llama2": llama2_tokenizer,
    "metaspace": metaspace_tokenizer,
    "wordpiece": wordpiece_tokenizer,
}


def offset_detokenizer(
    tok: Tokenizer, *, skip_special_tokens: bool, stop: Sequence[str] = ()
) -> IncrementalDetokenizer:
    return OffsetDetokenizer(tok, skip_special_tokens=skip_special_tokens, stop=stop)


def stream_detokenizer(
    tok: Tokenizer, *, skip_special_tokens: bool, stop: Sequence[str] = ()
) -> IncrementalDetokenizer:
    """The Rust DecodeStream where the byte-level table is picked (it is exact there too);
    elsewhere what make_detokenizer picks."""
    det = make_detokenizer(tok, skip_special_tokens=skip_special_tokens, stop=stop)
    if isinstance(det, ByteLevelDetokenizer):
        return DecodeStreamDetokenizer(tok, skip_special_tokens=skip_special_tokens, stop=stop)
    return det


FACTORIES: dict[str, Callable[..., IncrementalDetokenizer]] = {
    "auto": make_detokenizer,
    "offset": offset_detokenizer,
    "stream": stream_detokenizer,
}

# -- reference ------------------------------------------------------------------------------------


def truncate(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Cut before the first stop string to complete (the longest on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and len(s) <= end and text.startswith(s, end - len(s))]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def stream(
    det: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int]
) -> tuple[list[str], str]:
    """Push ids in chunks of the given sizes (the last size repeats); returns (pushes, finish)."""
    out: list[str] = []
    i = 0
    while i < len(ids):
        size = sizes[min(len(out), len(sizes) - 1)]
        out.append(det.push(ids[i : i + size]))
        i += size
    return out, det.finish()


# -- the invariant, by hypothesis ----------------------------------------------------------------


@st.composite
def token_ids(draw: st.DrawFn, tok: Tokenizer) -> list[int]:
    vocab = tok.get_vocab_size()
    specials = sorted(tok.get_added_tokens_decoder())

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    piece = st.one_of(
        st.integers(0, vocab - 1).map(lambda i: [i]),
        st.sampled_from(specials).map(lambda i: [i]),
        st.text(max_size=8).map(encode),
        st.sampled_from(["😀", "你好", " é", "\ufffd", " the"]).map(encode),
    )
    return [i for p in draw(st.lists(piece, max_size=14)) for i in p]


@pytest.mark.parametrize("factory", sorted(FACTORIES))
@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stream_equals_full_decode_cut_at_stop(tok_name: str, factory: str, data: st.DataObject):
    tok = TOKENIZERS[tok_name]()
    ids = data.draw(token_ids(tok), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    full = tok.decode(ids, skip_special_tokens=skip)
    stop_text = st.text(
        alphabet=st.sampled_from(sorted(set(full + "ab ."))), min_size=1, max_size=3
    )
    substring = st.integers(0, max(len(full) - 1, 0)).flatmap(
        lambda i: st.integers(1, 4).map(lambda n: full[i : i + n])
    )
    stops = data.draw(st.lists(st.one_of(stop_text, substring), max_size=3), label="stops")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=8), label="sizes")

    det = FACTORIES[factory](tok, skip_special_tokens=skip, stop=stops)
    pushed, tail = stream(det, ids, sizes)
    expected, matched = truncate(full, stops)
    assert "".join(pushed) + tail == expected
    assert det.matched_stop == matched
    assert det.stopped == (matched is not None)
    assert det.push([1]) == "" and det.finish() == ""  # finished


# -- specific behaviour ---------------------------------------------------------------------------


def test_factory_picks_by_decoder() -> None:
    det = make_detokenizer(default_tokenizer(), skip_special_tokens=True)
    assert isinstance(det, ByteLevelDetokenizer)
    assert isinstance(
        make_detokenizer(metaspace_tokenizer(), skip_special_tokens=True), DecodeStreamDetokenizer
    )
    assert isinstance(
        make_detokenizer(wordpiece_tokenizer(), skip_special_tokens=True), OffsetDetokenizer
    )
    det = make_detokenizer(llama2_tokenizer(), skip_special_tokens=True)
    assert isinstance(det, OffsetDetokenizer) and len(det._byte_ids) == 256
    assert isinstance(
        make_detokenizer(Tokenizer(models.BPE()), skip_special_tokens=True), OffsetDetokenizer
    )  # no decoder at all


@pytest.mark.parametrize("tok_name", ["bytelevel", "llama2"])
@pytest.mark.parametrize("factory", sorted(FACTORIES))
def test_split_character_is_held_until_complete(tok_name: str, factory: str) -> None:
    tok = TOKENIZERS[tok_name]()
    ids = tok.encode("a😀", add_special_tokens=False).ids
    assert len(ids) >= 3  # the emoji is split into byte tokens
    det = FACTORIES[factory](tok, skip_special_tokens=True)
    pushed = [det.push([i]) for i in ids]
    tail = det.finish()
    assert "\ufffd" not in "".join(pushed) + tail
    assert "".join(pushed) + tail == tok.decode(ids) == "a😀"
    if tok_name == "bytelevel":
        assert pushed[-1] == "😀" and tail == ""
    else:  # a run of <0xNN> tokens is final only when a non-byte token or finish ends it
        assert pushed[-1] == "" and tail == "😀"


@pytest.mark.parametrize("factory", sorted(FACTORIES))
def test_incomplete_character_comes_out_at_finish(factory: str) -> None:
    tok = default_tokenizer()
    ids = tok.encode("ok 😀", add_special_tokens=False).ids[:-1]
    det = FACTORIES[factory](tok, skip_special_tokens=True)
    assert "".join(det.push([i]) for i in ids) == "ok "
    assert det.finish() == tok.decode(ids)[3:] == "\ufffd"


def test_stop_string_spanning_tokens() -> None:
    tok = default_tokenizer()
    ids = tok.encode("The river rises in the hills.", add_special_tokens=False).ids
    det = make_detokenizer(tok, skip_special_tokens=True, stop=["rises in", "hills"])
    pushed = [det.push([i]) for i in ids]
    assert "".join(pushed) == "The river "
    assert det.stopped and det.matched_stop == "rises in"
    assert det.finish() == ""

    det = make_detokenizer(tok, skip_special_tokens=True, stop=["er ri"])
    assert det.push(ids[:2]) == "The riv"  # "er" might start the stop string: held
    assert det.push(ids[2:]) == ""
    assert det.matched_stop == "er ri"


def test_held_stop_prefix_is_released() -> None:
    tok = default_tokenizer()
    ids = tok.encode("one two", add_special_tokens=False).ids
    det = make_detokenizer(tok, skip_special_tokens=True, stop=["twofold", "ex"])
    assert "".join(det.push([i]) for i in ids) == "one "
    assert det.finish() == "two"
    assert not det.stopped and det.matched_stop is None


def test_include_stop_and_first_completed_stop_wins() -> None:
    tok = default_tokenizer()
    ids = tok.encode("abcdef", add_special_tokens=False).ids
    det = make_detokenizer(tok, skip_special_tokens=True, stop=["bcdef", "cd"], include_stop=True)
    out, tail = stream(det, ids, [1])
    assert "".join(out) + tail == "abcd" and det.matched_stop == "cd"


@pytest.mark.parametrize("factory", sorted(FACTORIES))
def test_skip_special_tokens(factory: str) -> None:
    tok = default_tokenizer()
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>", add_special_tokens=True).ids
    shown = FACTORIES[factory](tok, skip_special_tokens=False)
    pushed, tail = stream(shown, ids, [1])
    assert "".join(pushed) + tail == "<|begin_of_text|><|im_start|>assistant\nHi!<|im_end|>"
    hidden = FACTORIES[factory](tok, skip_special_tokens=True)
    pushed, tail = stream(hidden, ids, [1])
    assert "".join(pushed) + tail == "assistant\nHi!"
    stopped = FACTORIES[factory](tok, skip_special_tokens=False, stop=["<|im_end|>"])
    pushed, tail = stream(stopped, ids, [2])
    assert "".join(pushed) + tail == "<|begin_of_text|><|im_start|>assistant\nHi!"


@pytest.mark.parametrize(("stop", "expected"), [
    (["sat"], "Tomas laughed 😀 and "),  # the general path
    ([], "Tomas laughed 😀 and sat down."),  # one id a push and no stops: push's short path
])
def test_decode_stream_failure_falls_back_exactly(stop: list[str], expected: str) -> None:
    class Broken:
        def step(self, tokenizer: Tokenizer, token_id: int) -> str | None:
            raise RuntimeError("Invalid prefix encountered")

    tok = default_tokenizer()
    ids = tok.encode("Tomas laughed 😀 and sat down.", add_special_tokens=False).ids
    det = stream_detokenizer(tok, skip_special_tokens=True, stop=stop)
    first = "".join(det.push([i]) for i in ids[:5])
    assert isinstance(det, DecodeStreamDetokenizer)
    det._stream = Broken()  # type: ignore[assignment]
    rest, tail = stream(det, ids[5:], [1])
    assert first + "".join(rest) + tail == expected
    assert det.matched_stop == (stop[0] if stop else None)


def test_empty_pushes_and_no_ids() -> None:
    det = make_detokenizer(default_tokenizer(), skip_special_tokens=True, stop=["x", ""])
    assert det.push([]) == ""
    assert det.finish() == ""
    assert det.push([5]) == "" and not det.stopped


def _byte_token(tok: Tokenizer, byte: int) -> int:
    """The id of the byte-level token that stands for `byte` alone."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + shifted.index(byte))
    token_id = tok.token_to_id(char)
    assert token_id is not None
    return token_id


@pytest.mark.parametrize("raw", [
    b"\xf0\x80\x80A",  # an impossible second byte
    b"\xed\xa0\x80z",  # a surrogate's encoding
    b"\xe4\xbd",  # a character cut short at the end
    b"\xff\xfe ok",  # bytes that never start a character
    b"\xc3",  # the first half of "é" alone
])
def test_byte_level_invalid_bytes_decode_as_the_tokenizer_does(raw: bytes) -> None:
    tok = default_tokenizer()
    ids = [_byte_token(tok, b) for b in raw]
    for skip in (True, False):
        det = make_detokenizer(tok, skip_special_tokens=skip)
        assert isinstance(det, ByteLevelDetokenizer)
        pushed, tail = stream(det, ids, [1])
        assert "".join(pushed) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_byte_level_added_tokens_outside_the_byte_alphabet() -> None:
    """An added token spelled with characters the byte alphabet lacks stands for its own UTF-8
    bytes, special or not (a fresh tokenizer: the table is per tokenizer)."""
    tok = Tokenizer.from_str(default_tokenizer().to_str())
    tok.add_tokens(["你好", "ümlaut"])
    tok.add_special_tokens(["<|ключ|>"])
    ids = tok.encode("a你好 <|ключ|>ümlaut", add_special_tokens=False).ids
    for skip in (True, False):
        det = make_detokenizer(tok, skip_special_tokens=skip)
        assert isinstance(det, ByteLevelDetokenizer)
        pushed, tail = stream(det, ids, [1])
        assert "".join(pushed) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert "你好" in tok.decode(ids) and "<|ключ|>" not in tok.decode(ids, skip_special_tokens=True)
