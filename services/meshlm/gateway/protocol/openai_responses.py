"""OpenAI's response and stream-chunk shapes for chat and completions, folded from the
gateway's updates. Pure: no I/O.

An `Answer` is one request's answer: choice i * n + j is sample j of prompt i (chat has one
prompt). Not streaming, each choice gets one merged update and `response()` is the whole reply:

    {"id", "object": "chat.completion" | "text_completion", "created", "model",
     "choices": [{"index", "message": {"role", "content"} | "text", "logprobs",
                  "finish_reason"}], "usage"}

Streaming, `add` returns the chunks due for each update ("object": "chat.completion.chunk" |
"text_completion"): chat starts every choice with a chunk whose delta is
{"role": "assistant", "content": "", "reasoning_content": null} (then, with `echo`, one with
the echoed content); then one chunk per update that brings text, with its tokens' logprobs
(chat deltas are {"content", "reasoning_content": null}; a reasoning model's thinking, read
by the gateway's reasoning parser, comes as "reasoning_content", SGLang's name, and again as
"reasoning", vLLM's current one). Tokens whose text the detokenizer
still holds back wait for it, so every chunk with text carries the logprobs of the tokens
that made it. A choice's last chunk carries its finish_reason together with its last text
and logprobs (as SGLang's completions and vLLM's do), never an empty chunk of its own. With
include_usage every chunk has "usage": null (the usage so far with vLLM's
continuous_usage_stats) and `usage_chunk()` (no choices) ends the stream.

With vLLM's prompt_logprobs (not streaming) completions' choices carry "prompt_logprobs" and
chat has it at the top (`openai_logprobs.prompt_logprobs`).

With vLLM's return_token_ids (`token_ids`) every choice (and stream chunk) carries its
output's "token_ids", and the prompt's ids come once: completions' choices carry
"prompt_token_ids" (in each choice's first chunk when streaming), chat has it at the top (in
the stream's first chunk). Absent otherwise, not null.

The id is the request's rid ("chatcmpl-<rid>", "cmpl-<rid>"); usage counts each prompt once
(its first sample's cached_tokens) and every sample's completion tokens.

Embeddings: {"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
"model", "usage": {"prompt_tokens", "total_tokens"}}.
"""

from __future__ import annotations

from base64 import b64encode
from collections.abc import Callable
from typing import Any

import numpy as np

from meshlm.gateway.mesh.inbox import Update
from meshlm.gateway.protocol.chat_output import ChatOutput, Pieces
from meshlm.gateway.protocol.choices import merge_updates
from meshlm.gateway.protocol.openai_logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    prompt_logprobs,
)

Chunk = dict[str, Any]


def parent_rid(meta: dict[str, str]) -> str:
    """The request's rid from a message's meta_info (n > 1: a child's id is "<rid>-<index>")."""
    rid = meta.get("id", "")
    return rid.rsplit("-", 1)[0] if "index" in meta else rid


class Answer:
    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, *, model: str, created: int, n: int, prompts: int, stream: bool,
                 include_usage: bool, top_logprobs: int | None,
                 continuous_usage: bool = False, token_ids: bool = False,
                 tokens_as_ids: bool = False, prompt_logprobs: int | None = None,
                 asked_ids: bool = False) -> None:
        self.model = model
        self.created = created
        self.n = n
        self.stream = stream
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.top_logprobs = top_logprobs
        self.token_ids = token_ids  # vLLM's return_token_ids
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids
        self.prompt_logprobs = prompt_logprobs  # vLLM's: top ones per prompt position
        self.asked_ids = asked_ids  # vLLM's logprob_token_ids: listed in place of the top ones
        self.id = ""
        count = n * prompts
        self.updates: list[Update | None] = [None] * count  # not streaming: merged, final
        self.finish: list[str | None] = [None] * count
        self.done = False  # every choice has finished (kept, not computed: read per update)
        self._running = count
        self._started = [False] * count
        self._held: list[list[Update]] = [[] for _ in range(count)]  # tokens without text
        self._completion_tokens = [0] * count
        self._prompt_tokens = [0] * prompts
        self._cached_tokens = [0] * prompts

    def add(self, prompt: int, update: Update, meta: dict[str, str]) -> list[Chunk]:
        """Take one update of prompt `prompt`'s stream; returns the chunks due (streaming)."""
        sample = int(meta.get("index", "0"))
        index = prompt * self.n + sample
        if not self.id:
            self.id = self.id_prefix + parent_rid(meta)
        if sample == 0:
            self._prompt_tokens[prompt] = update.prompt_tokens
            self._cached_tokens[prompt] = update.cached_tokens
        chunks = []
        if self.stream and not self._started[index]:
            self._started[index] = True
            # Before its tokens count: the usage in an opening chunk has none of them yet.
            chunks += self._first_chunks(index, update)
        self._completion_tokens[index] = update.completion_tokens
        self._read(index, update)
        if update.final is not None:
            if self.finish[index] is None:
                self._running -= 1
                self.done = not self._running
            self.finish[index] = self._finish_reason(index, update.final.finish_reason)
        if not self.stream:
            self.updates[index] = update
            return []
        reason = self.finish[index]
        if reason is None and not self._has_text(index, update):
            self._held[index].append(update)
            return chunks
        chunks.append(self._chunk(self._stream_choice(index, self._with_held(index, update),
                                                      reason)))
        return chunks

    def response(self) -> Chunk:
        """The whole reply (not streaming), once every choice has finished."""
        choices = [self._full_choice(i, u) for i, u in enumerate(self.updates) if u is not None]
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}

    def usage(self) -> dict[str, Any]:
        prompt, completion = sum(self._prompt_tokens), sum(self._completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens)}}

    def usage_chunk(self) -> Chunk:
        return {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage()}

    def _with_held(self, index: int, update: Update) -> Update:
        """`update` with the tokens held before it, whose text had not come (their ids and
        logprobs go in the chunk their text comes in)."""
        held, self._held[index] = self._held[index], []
        return merge_updates([*held, update]) if held else update

    def _chunk(self, choice: Chunk) -> Chunk:
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created,
                 "model": self.model, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = self.usage() if self.continuous_usage else None
        return chunk

    # -- per kind ----------------------------------------------------------------------------

    def _first_chunks(self, index: int, update: Update) -> list[Chunk]:
        """The chunks that open choice `index`'s stream (`update` is its first)."""
        return []

    def _finish_reason(self, index: int, reason: str) -> str:
        """The finish_reason the client sees for the engine's."""
        return reason

    def _read(self, index: int, update: Update) -> None:
        """See each update once, in order, before it is sent, held or kept."""

    def _has_text(self, index: int, update: Update) -> bool:
        """Whether `update` gives choice `index`'s stream text to send."""
        return bool(update.text)

    def _stream_choice(self, index: int, update: Update, reason: str | None) -> Chunk:
        """The choice of one stream chunk: `update`'s text and logprobs, and the finish_reason
        when it is the last."""
        raise NotImplementedError

    def _full_choice(self, index: int, update: Update) -> Chunk:
        raise NotImplementedError


class ChatAnswer(Answer):
    """`echo`: the text every choice starts with (vLLM's chat echo: the last message's content
    when it is the assistant's); streaming, it has a chunk of its own after the role's."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, *, echo: str | None = None,
                 output: Callable[[], ChatOutput] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.echo = echo
        self._prompt_ids_sent = False
        # With a reasoning parser or tools that may be called: each choice's output read as
        # reasoning, content and tool calls.
        self._outputs = [output() if output else None for _ in self.updates]
        self._unsent = [Pieces() for _ in self.updates]

    def response(self) -> Chunk:
        body = super().response()
        first = self.updates[0]
        if self.token_ids:
            body["prompt_token_ids"] = (first.prompt_ids if first is not None else None) or []
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs(first.logprobs if first is not None else None,
                                                      self.prompt_logprobs)
        return body

    def _logprobs(self, update: Update) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(update.logprobs, self.top_logprobs, update.token_ids,
                             self.tokens_as_ids, self.asked_ids)

    def _first_chunks(self, index: int, update: Update) -> list[Chunk]:
        first = [self._chunk(_delta(index, {"role": "assistant", "content": ""}))]
        if self.token_ids and not self._prompt_ids_sent and update.prompt_ids is not None:
            self._prompt_ids_sent = True  # in the stream's first chunk only
            first[0]["prompt_token_ids"] = update.prompt_ids
        if self.echo:
            first.append(self._chunk(_delta(index, {"content": self.echo})))
        return first

    def _finish_reason(self, index: int, reason: str) -> str:
        output = self._outputs[index]
        return "tool_calls" if output and reason == "stop" and output.tool_calls() else reason

    def _read(self, index: int, update: Update) -> None:
        output = self._outputs[index]
        if output is not None:
            self._unsent[index] += output.feed(update.text, update.final is not None)

    def _has_text(self, index: int, update: Update) -> bool:
        if self._outputs[index] is not None:  # what its reader has made of the text
            return bool(self._unsent[index])
        return bool(update.text)

    def _stream_choice(self, index: int, update: Update, reason: str | None) -> Chunk:
        if self._outputs[index] is not None:
            pieces, self._unsent[index] = self._unsent[index], Pieces()
            delta: Chunk = {"content": pieces.content} if pieces.content else {}
            if pieces.reasoning:  # SGLang's name, and vLLM's current one
                delta["reasoning_content"] = delta["reasoning"] = pieces.reasoning
            if pieces.calls:
                delta["tool_calls"] = pieces.calls
        else:
            delta = {"content": update.text}
        choice = _delta(index, delta, self._logprobs(update), reason)
        if self.token_ids:
            choice["token_ids"] = update.token_ids
        return choice

    def _full_choice(self, index: int, update: Update) -> Chunk:
        message: Chunk = {"role": "assistant", "content": (self.echo or "") + update.text,
                          "reasoning_content": None}
        output = self._outputs[index]
        if output is not None:
            content = (self.echo or "") + output.content()
            message["reasoning_content"] = reasoning = output.reasoning()
            if reasoning is not None:
                message["reasoning"] = reasoning  # vLLM's name for it now
            if calls := output.tool_calls():
                message["tool_calls"] = calls
            message["content"] = content or (None if calls else "")
        choice = {"index": index, "message": message, "logprobs": self._logprobs(update),
                  "finish_reason": self.finish[index]}
        if self.token_ids:
            choice["token_ids"] = update.token_ids
        return choice


def _delta(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
           reason: str | None = None) -> Chunk:
    """A chat stream choice; its delta says "reasoning_content": null unless it has some, as
    SGLang's do."""
    return {"index": index, "delta": {"reasoning_content": None, **delta},
            "logprobs": logprobs, "finish_reason": reason}


class CompletionAnswer(Answer):
    """`echo`: each prompt's text when the client asked for it back (prefixed to its choices'
    text; with logprobs, the prompt's tokens lead the choice's entries)."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, *, echo: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.echo = echo
        top = self.top_logprobs
        self._logprobs = [CompletionLogprobs(top, as_ids=self.tokens_as_ids,
                                             asked=self.asked_ids)
                          if top is not None else None for _ in self.updates]
        self._echoed = [False] * len(self.updates)

    def _text_and_logprobs(self, index: int, update: Update) -> tuple[str, dict[str, Any] | None]:
        text = update.text
        echo = self.echo is not None and not self._echoed[index]
        if echo and self.echo is not None:
            self._echoed[index] = True
            text = self.echo[index // self.n] + text
        builder = self._logprobs[index]
        logprobs = (builder.add(update.logprobs, echo, update.token_ids)
                    if builder is not None else None)
        return text, logprobs

    def _with_ids(self, choice: Chunk, update: Update, whole: bool) -> Chunk:
        """return_token_ids: the output's ids, and the prompt's (`whole`: always; streaming:
        in the choice's first chunk, the update that brings them)."""
        if self.token_ids:
            if whole or update.prompt_ids is not None:
                choice["prompt_token_ids"] = update.prompt_ids or []
            choice["token_ids"] = update.token_ids
        return choice

    def _has_text(self, index: int, update: Update) -> bool:
        return bool(update.text) or (self.echo is not None and not self._echoed[index])

    def _stream_choice(self, index: int, update: Update, reason: str | None) -> Chunk:
        text, logprobs = self._text_and_logprobs(index, update)
        return self._with_ids({"index": index, "text": text, "logprobs": logprobs,
                               "finish_reason": reason}, update, whole=False)

    def _full_choice(self, index: int, update: Update) -> Chunk:
        text, logprobs = self._text_and_logprobs(index, update)
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": self.finish[index]}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(update.logprobs, self.prompt_logprobs)
        return self._with_ids(choice, update, whole=True)


def embedding_body(model: str, vectors: list[list[float]], prompt_tokens: int, *,
                   base64: bool) -> dict[str, Any]:
    """OpenAI's embeddings reply; `base64`: each vector as base64 of little-endian float32."""
    data = []
    for i, vector in enumerate(vectors):
        array = np.asarray(vector, dtype="<f4")
        value: Any = b64encode(array.tobytes()).decode() if base64 else array
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
