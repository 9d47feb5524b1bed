"""SGLang-native /generate and /encode output: api messages folded into SGLang's JSON, and SSE
framing.

SGLang's /generate answers {"text", "output_ids", "meta_info"}; when streaming, every
Server-Sent Event carries the same shape with the text and ids so far (cumulative), and the
stream ends with `data: [DONE]`. The api streams deltas (text, output_ids) with meta_info as
strings, as TextGenerate's and Generate's messages but not yet protos (`Generated`: filling a
proto's map and reading it back cost more than the rest); `NativeOutput` accumulates them, the
logprob lists included (real JSON arrays here, cumulative like the text). With n > 1 samples
(`NativeChoices`) each sample is one such object with an "index": a JSON list of n of them, or
events for each sample in turn as its news arrives. A batch of prompts answers the same way,
the prompts' samples numbered one after another. /encode answers {"embedding", "meta_info"}.

A streamed event repeats the text and ids so far, so encoding each one whole costs time that
grows with the output. `NativeOutput.event` keeps both as JSON fragments instead, each new
piece encoded once and appended (JSON escapes character by character, so the fragments of the
pieces are the fragment of the whole), and writes the event around them: the bytes
`sse_event(to_dict())` gives, at a cost that no longer grows with the output (fold and encode,
one CPU, micro: 230-token outputs 2.4-2.5 -> 2.25 µs an event, 1000-token 3.4-3.6 -> 2.3).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson

from meshlm.common.packed import Plain
from meshlm.gateway.api.generation import Generated
from meshlm.gateway.protocol.logprob_meta import LOGPROB_KEYS
from sglang.runtime.v1 import sglang_pb2

SSE_DONE = b"data: [DONE]\n\n"

_COUNTS = ("prompt_tokens", "completion_tokens", "cached_tokens")
_LOGPROB_KEYS = frozenset(LOGPROB_KEYS)
_CONSUMED = {"id", "index", "finish_reason", "matched_stop", "matched_stop_type", "e2e_latency",
             *_COUNTS, *LOGPROB_KEYS}
_RUNNING = {"id", "index", *_COUNTS}  # a running message's meta_info keys (`running_meta`)

# The api's messages, as protos or not yet (`api/generation.Generated`): the same fields.
GenerateMessage = sglang_pb2.TextGenerateResponse | sglang_pb2.GenerateResponse | Generated
EmbedMessage = sglang_pb2.TextEmbedResponse | sglang_pb2.EmbedResponse


def sse_event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class NativeOutput:
    """Accumulates one request's response stream into SGLang's /generate shape.

    Text is reported for text requests only; ids always (TextGenerateResponse carries them as
    meshlm's extension of the public proto).
    """

    def __init__(self, *, return_text: bool, max_new_tokens: int, started: float,
                 index: int | None = None) -> None:
        self.index = index  # the sample's index when the request asked for n > 1
        self.return_text = return_text
        self.max_new_tokens = max_new_tokens
        self.started = started  # time.monotonic() when the HTTP request arrived
        self.text = ""
        self.output_ids: list[int] | None = None
        self.meta: dict[str, str | int] = {}  # meta_info so far (counts: str or int)
        self.logprobs: dict[str, list[Any]] = {}
        self.finished = False
        self._text_json = bytearray()  # the text so far, JSON-escaped, without its quotes
        self._ids_json = bytearray()   # the ids so far, as JSON array items: b"1,2,3"

    def add(self, message: GenerateMessage, meta: dict[str, str] | None = None) -> None:
        """Fold in `message`; `meta`: its meta_info as a dict, if it was read already."""
        if meta is None:
            meta = _meta_dict(message)
        # Both carry ids (TextGenerateResponse: meshlm's extension); GenerateResponse no text.
        self._fold(message.text if self.return_text else "", message.output_ids)
        self.meta.update(meta)
        if not _LOGPROB_KEYS.isdisjoint(meta):
            for key in LOGPROB_KEYS:
                value = meta.get(key)
                if value is not None:
                    self.logprobs.setdefault(key, []).extend(orjson.loads(value))
        self.finished = self.finished or message.finished

    def running_event(self, item: Plain) -> bytes | None:
        """Fold in a running output as the inbox has it (`api/direct.py`: rid, new ids, the
        three counts, new text) and return its SSE event: the bytes `add` of its message and
        `event()` give, made from the counts as numbers rather than through meta_info's
        strings and back. None, with nothing folded in, where the event is not the plain one
        (logprobs, meta_info keys of the request's own, or a sample already finished)."""
        meta = self.meta
        if self.logprobs or self.finished or not meta.keys() <= _RUNNING:
            return None
        rid, ids, prompt, completion, cached, text = item
        self._fold(text, ids)
        meta["id"], meta["prompt_tokens"] = rid, prompt  # numbers: `_int` takes them as they are
        meta["completion_tokens"], meta["cached_tokens"] = completion, cached
        return self._event(b'{"id":%b,"finish_reason":null,"prompt_tokens":%d,'
                           b'"completion_tokens":%d,"cached_tokens":%d,"e2e_latency":%b}' % (
                               orjson.dumps(rid), prompt, completion, cached,
                               orjson.dumps(round(time.monotonic() - self.started, 6))))

    def _fold(self, text: str, ids: Sequence[int]) -> None:
        """Append a message's new text and ids, and their JSON fragments."""
        if self.return_text and text:
            self.text += text
            self._text_json += orjson.dumps(text)[1:-1]
        if self.output_ids is None:
            self.output_ids = []
        if ids:
            if self.output_ids:
                self._ids_json += b","
            self._ids_json += (b"%d" % ids[0] if len(ids) == 1
                               else orjson.dumps(list(ids))[1:-1])
            self.output_ids.extend(ids)

    def _event(self, meta_info: bytes) -> bytes:
        """The SSE event of the text and ids so far, with `meta_info` (its JSON)."""
        parts: list[bytes | bytearray] = (
            [b'data: {"text":"', self._text_json, b'","output_ids":['] if self.return_text
            else [b'data: {"output_ids":['])
        parts += [self._ids_json, b'],"meta_info":', meta_info]
        if self.index is not None:
            parts += [b',"index":', b"%d" % self.index]
        parts.append(b"}\n\n")
        return b"".join(parts)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.return_text:
            out["text"] = self.text
        if self.output_ids is not None:
            out["output_ids"] = self.output_ids
        out["meta_info"] = self._meta_info()
        if self.index is not None:
            out["index"] = self.index
        return out

    def event(self) -> bytes:
        """The SSE event of `to_dict()`, byte for byte, written around the kept fragments."""
        if self.logprobs or self.output_ids is None:  # rare: encoded whole
            return sse_event(self.to_dict())
        return self._event(orjson.dumps(self._meta_info()))

    def _meta_info(self) -> dict[str, Any]:
        meta = self.meta
        get = meta.get
        info: dict[str, Any] = {
            "id": get("id", ""),
            "finish_reason": self._finish_reason() if self.finished else None,
            "prompt_tokens": _int(get("prompt_tokens", "0")),
            "completion_tokens": _int(get("completion_tokens", "0")),
            "cached_tokens": _int(get("cached_tokens", "0")),
            "e2e_latency": round(time.monotonic() - self.started, 6)}
        if not meta.keys() <= _CONSUMED:  # keys of its own (rare), in their order
            for key, value in meta.items():
                if key not in _CONSUMED:
                    info[key] = value
        if self.logprobs:
            info.update(self.logprobs)
        return info

    def _finish_reason(self) -> dict[str, Any] | None:
        kind = self.meta.get("finish_reason")
        if not kind:
            return None
        reason: dict[str, Any] = {"type": kind}
        matched = self.meta.get("matched_stop")
        if matched is not None:
            token = self.meta.get("matched_stop_type") == "token"
            reason["matched"] = _int(matched) if token else matched
        if kind == "length":
            reason["length"] = self.max_new_tokens
        return reason


class NativeChoices:
    """The n samples of one /generate prompt, each a NativeOutput, found by the messages'
    meta_info["index"]. n == 1 outside a batch: one object without an index, as SGLang
    answers; otherwise each sample carries "index" = `offset` + its sample number (a batch's
    prompts take consecutive ranges of indices)."""

    def __init__(self, n: int, *, return_text: bool, max_new_tokens: int,
                 started: float, offset: int = 0, indexed: bool = False) -> None:
        self.indexed = indexed or n > 1
        self.outputs = [NativeOutput(return_text=return_text, max_new_tokens=max_new_tokens,
                                     started=started,
                                     index=offset + i if self.indexed else None)
                        for i in range(n)]

    def add(self, message: GenerateMessage) -> NativeOutput:
        """Fold in one message; returns the sample it belongs to."""
        meta = _meta_dict(message)
        index = _int(meta["index"]) if "index" in meta else 0
        out = self.outputs[index if isinstance(index, int) else 0]
        out.add(message, meta)
        return out

    def dicts(self) -> list[dict[str, Any]]:
        return [out.to_dict() for out in self.outputs]

    def to_json(self) -> Any:
        if not self.indexed:
            return self.outputs[0].to_dict()
        return self.dicts()


def native_embedding(message: EmbedMessage, started: float) -> dict[str, Any]:
    """An Embed/TextEmbed reply in /encode's shape."""
    meta = message.meta_info
    info: dict[str, Any] = {"id": meta.get("id", ""), "finish_reason": {"type": "stop"}}
    for key in ("prompt_tokens", "cached_tokens"):
        info[key] = _int(meta.get(key, "0"))
    info["e2e_latency"] = round(time.monotonic() - started, 6)
    return {"embedding": list(message.embedding), "meta_info": info}


def _meta_dict(message: GenerateMessage) -> dict[str, str]:
    """A message's meta_info as a dict: as it is (Generated), or read once from the proto map
    (then dict lookups)."""
    meta = message.meta_info
    return meta if isinstance(meta, dict) else dict(meta)


def _int(value: str | int) -> int | str:
    try:
        return int(value)
    except ValueError:
        return value
