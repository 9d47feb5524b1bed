"""Incremental detokenization: one object per request turns new token ids into new text.

The contract, for any chunking of the ids into `push` calls followed by `finish`:

    "".join(outputs) == truncate(tokenizer.decode(ids, skip_special_tokens), stop)

where `truncate` cuts the text just before the first stop string to complete (reading left to
right; of two completing at the same character, the longer wins), or keeps it whole if none does.
So a split multi-byte character is held back until it is complete, and text that could be the
start of a stop string is held back until it is known not to be one. `finish` releases what is
held, decoded exactly as `tokenizer.decode` decodes it (an incomplete trailing character comes
out as U+FFFD).

`make_detokenizer` picks the implementation for a tokenizer:

- `ByteLevelDetokenizer`: for a decoder that is ByteLevel alone (GPT-2, Llama-3, Qwen): each
  token stands for fixed bytes (token_bytes.py), so a step is a table lookup and, where a
  character spans tokens, Python's incremental UTF-8 decoder.
- `DecodeStreamDetokenizer`: the Rust `tokenizers.decoders.DecodeStream`, for decoders whose
  output is stable under appending tokens (ByteLevel, Metaspace, Replace/Fuse/Strip chains).
- `OffsetDetokenizer`: the prefix/read-offset window of vLLM and SGLang's DecodeStatus, for the
  rest. With a ByteFallback decoder (Llama-2, Mistral) it also waits for a run of `<0xNN>` byte
  tokens to end, since appending a byte can turn earlier valid bytes into U+FFFD.

Both decode only a few recent tokens per step; the whole sequence is decoded once at most, in
`finish`, and only when text is still held back.
"""

from __future__ import annotations

import codecs
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream  # tokenizers >= 0.21

from meshlm.detokenizer.token_bytes import ByteLevelTable

_REPLACEMENT = "\ufffd"
# Decoders under which decode(ids + more) always starts with decode(ids) once the latter ends in
# a complete character: DecodeStream is exact for them.
_STREAM_SAFE_DECODERS = frozenset({"ByteLevel", "Metaspace", "Replace", "Fuse", "Strip"})


class IncrementalDetokenizer(ABC):
    """Per-request incremental detokenizer with stop-string handling (see the module doc)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool,
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._include_stop = include_stop
        self._ids: list[int] = []
        self._raw_len = 0  # characters of decoded text produced so far (before stop handling)
        self._pending = ""  # produced, but held back: it could be the start of a stop string
        self._done = False
        self.matched_stop: str | None = None  # the stop string that ended the text, if any
        self._setup()

    @abstractmethod
    def _setup(self) -> None:
        """Per-implementation state, set up at the end of __init__."""

    @property
    def stopped(self) -> bool:
        """True once a stop string has appeared; push() and finish() return "" from then on."""
        return self.matched_stop is not None

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far (do not modify)."""
        return self._ids

    def push(self, token_ids: Sequence[int]) -> str:
        """Feed the request's new token ids; return the new text that is safe to emit."""
        if self._done or not token_ids:
            return ""
        start = len(self._ids)
        self._ids.extend(token_ids)
        return self._release(self._decode_new(start), final=False)

    def finish(self) -> str:
        """The request ended (eos, length, abort): return all text still held back."""
        if self._done:
            return ""
        tail = self._tail() if self._holds_tokens() else ""
        out = self._release(tail, final=True)
        self._done = True
        return out

    @abstractmethod
    def _decode_new(self, start: int) -> str:
        """Decode ids[start:] (just appended); return the new complete text ("" to hold)."""

    @abstractmethod
    def _holds_tokens(self) -> bool:
        """Whether some pushed ids have not been turned into text yet."""

    def _tail(self) -> str:
        """At finish: the text of the ids not yet turned into text."""
        return self._decode_all()[self._raw_len :]

    def _decode_all(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)

    def _release(self, raw: str, *, final: bool) -> str:
        """Apply the stop strings to newly decoded text; return what can be emitted."""
        self._raw_len += len(raw)
        if not self._stops:
            return raw
        text = self._pending + raw
        hit = _first_stop(text, self._stops)
        if hit is not None:
            index, stop = hit
            self._pending = ""
            self.matched_stop = stop
            self._done = True
            return text[: index + len(stop)] if self._include_stop else text[:index]
        keep = 0 if final else _partial_stop_len(text, self._stops)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


class ByteLevelDetokenizer(IncrementalDetokenizer):
    """For a ByteLevel decoder: each id's bytes from the tokenizer's table, decoded by this
    request's incremental UTF-8 decoder (U+FFFD for invalid bytes, as the tokenizer's decode
    gives; the start of a character is held until it completes or the request finishes)."""

    def _setup(self) -> None:
        self._table = _plan(self._tokenizer).byte_table(self._skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._partial = False  # the UTF-8 decoder holds the start of a character

    def push(self, token_ids: Sequence[int]) -> str:
        """One new id and no stop strings (a running request's every step, as a rule): its
        text is one lookup when no character is split."""
        if len(token_ids) != 1 or self._stops or self._done:
            return super().push(token_ids)
        token_id = token_ids[0]
        self._ids.append(token_id)
        text = None if self._partial else self._table.text.get(token_id)
        if text is None:
            text = self._decode(token_id)
        self._raw_len += len(text)
        return text

    def _decode(self, token_id: int) -> str:
        text = self._utf8.decode(self._table.bytes_of(token_id))
        self._partial = bool(self._utf8.getstate()[0])
        return text

    def _decode_new(self, start: int) -> str:
        return "".join([self._decode(token_id) for token_id in self._ids[start:]])

    def _holds_tokens(self) -> bool:
        return self._partial

    def _tail(self) -> str:
        self._partial = False
        return self._utf8.decode(b"", final=True)


class DecodeStreamDetokenizer(IncrementalDetokenizer):
    """Fast path: the Rust DecodeStream (for stream-safe decoders only; see make_detokenizer)."""

    def _setup(self) -> None:
        self._stream: DecodeStream | None = DecodeStream(
            skip_special_tokens=self._skip_special_tokens)
        self._decoded_upto = 0  # ids before this index are all in the text produced

    def push(self, token_ids: Sequence[int]) -> str:
        """One new id and no stop strings (a running request's every step, as a rule): the
        stream's step alone, without the general path's chunk list and stop handling."""
        if len(token_ids) != 1 or self._stops or self._stream is None or self._done:
            return super().push(token_ids)
        ids = self._ids
        ids.append(token_ids[0])
        try:
            chunk = self._stream.step(self._tokenizer, token_ids[0])
        except Exception:  # rejected ("invalid prefix"): the general path's fallback
            self._stream = None
            chunk = self._decode_by_full_text(0)
        else:
            if chunk is None:
                return ""
            self._decoded_upto = len(ids)
        self._raw_len += len(chunk)
        return chunk

    def _decode_new(self, start: int) -> str:
        if self._stream is None:
            return self._decode_by_full_text(0)
        chunks: list[str] = []
        try:
            for i in range(start, len(self._ids)):
                chunk = self._stream.step(self._tokenizer, self._ids[i])
                if chunk is not None:
                    chunks.append(chunk)
                    self._decoded_upto = i + 1
        except Exception:
            # DecodeStream rejected the sequence ("invalid prefix"): go on exactly, but slowly.
            self._stream = None
            produced = "".join(chunks)
            return produced + self._decode_by_full_text(len(produced))
        return "".join(chunks)

    def _decode_by_full_text(self, produced: int) -> str:
        """New text from a full decode; `produced` chars are not yet counted in _raw_len."""
        text = self._decode_all()
        if text.endswith(_REPLACEMENT):
            return ""
        self._decoded_upto = len(self._ids)
        return text[self._raw_len + produced :]

    def _holds_tokens(self) -> bool:
        return self._decoded_upto < len(self._ids)


class OffsetDetokenizer(IncrementalDetokenizer):
    """Fallback: decode a window from the previous emit point and diff (vLLM/SGLang style).

    With a ByteFallback decoder, text is not committed while the last token is a `<0xNN>` byte
    token: the decoder turns a whole run of byte tokens into U+FFFDs if any byte of the run is
    invalid, so a run is final only once a non-byte token (or finish) ends it.
    """

    def _setup(self) -> None:
        plan = _plan(self._tokenizer)
        self._byte_ids = plan.byte_ids
        # With skip_special_tokens the decoder never sees special tokens: they do not end a run.
        self._transparent_ids = plan.special_ids if self._skip_special_tokens else frozenset()
        self._prefix_offset = 0  # window start: ids[prefix:read] decode to _prefix_text
        self._read_offset = 0  # ids before this index are all in the text produced
        self._prefix_text = ""

    def _decode_new(self, start: int) -> str:
        ids = self._ids
        if self._byte_ids and self._in_byte_run():
            return ""
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        text = decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if text.endswith(_REPLACEMENT) or len(text) <= len(self._prefix_text):
            return ""
        new_text = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self._prefix_text = decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        return new_text

    def _holds_tokens(self) -> bool:
        return self._read_offset < len(self._ids)

    def _in_byte_run(self) -> bool:
        for token_id in reversed(self._ids):
            if token_id in self._byte_ids:
                return True
            if token_id not in self._transparent_ids:
                return False
        return False


def make_detokenizer(
    tokenizer: Tokenizer,
    *,
    skip_special_tokens: bool,
    stop: Sequence[str] = (),
    include_stop: bool = False,
) -> IncrementalDetokenizer:
    """A new per-request detokenizer, of the fastest kind that is exact for this tokenizer.

    `stop`: strings that end the text (empty strings are ignored). `include_stop` keeps the
    matched stop string at the end of the text (SGLang's no_stop_trim); by default it is cut.
    """
    plan = _plan(tokenizer)
    if plan.byte_level:
        return ByteLevelDetokenizer(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            stop=stop,
            include_stop=include_stop,
        )
    if plan.use_stream:
        return DecodeStreamDetokenizer(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            stop=stop,
            include_stop=include_stop,
        )
    return OffsetDetokenizer(
        tokenizer,
        skip_special_tokens=skip_special_tokens,
        stop=stop,
        include_stop=include_stop,
    )


@dataclass(frozen=True)
class _Plan:
    """What make_detokenizer needs to know about a tokenizer, worked out once."""

    tokenizer: Tokenizer  # held, so that its id() stays unique while cached
    use_stream: bool  # DecodeStream is exact for its decoder
    byte_ids: frozenset[int]  # ByteFallback's <0xNN> tokens (empty without ByteFallback)
    special_ids: frozenset[int]  # added tokens that skip_special_tokens drops
    byte_level: bool = False  # ByteLevel alone, and its table checked against decode
    byte_tables: dict[bool, ByteLevelTable] = field(default_factory=dict)  # by skip_special

    def byte_table(self, skip_special_tokens: bool) -> ByteLevelTable:
        table = self.byte_tables.get(skip_special_tokens)
        if table is None:
            table = self.byte_tables[skip_special_tokens] = ByteLevelTable(
                self.tokenizer, self.special_ids if skip_special_tokens else frozenset())
        return table


_PLANS: dict[int, _Plan] = {}  # by id(tokenizer); a process has one or two tokenizers


def _plan(tokenizer: Tokenizer) -> _Plan:
    plan = _PLANS.get(id(tokenizer))
    if plan is not None and plan.tokenizer is tokenizer:
        return plan
    kinds = _decoder_types(tokenizer)
    byte_ids: frozenset[int] = frozenset()
    if "ByteFallback" in kinds:
        found = (tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
        byte_ids = frozenset(i for i in found if i is not None)
    specials = tokenizer.get_added_tokens_decoder().items()
    plan = _Plan(
        tokenizer=tokenizer,
        use_stream=bool(kinds) and kinds <= _STREAM_SAFE_DECODERS,
        byte_ids=byte_ids,
        special_ids=frozenset(i for i, t in specials if t.special),
    )
    if kinds - {"Sequence"} == {"ByteLevel"} and plan.byte_table(False).check():
        plan = replace(plan, byte_level=True, byte_tables=plan.byte_tables)
    _PLANS[id(tokenizer)] = plan
    return plan


def _decoder_types(tokenizer: Tokenizer) -> frozenset[str]:
    """The "type"s of the tokenizer's decoder and of every decoder nested in it."""
    decoder = tokenizer.decoder
    if decoder is None:
        return frozenset()
    kinds: set[str] = set()
    todo = [json.loads(decoder.__getstate__())]
    while todo:
        node = todo.pop()
        kinds.add(str(node.get("type")))
        todo.extend(d for d in node.get("decoders") or () if isinstance(d, dict))
    return frozenset(kinds)


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop) of the stop occurrence that completes first; the longer one on a tie."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0:
            key = (index + len(stop), index, stop)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else (best[1], best[2])


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
