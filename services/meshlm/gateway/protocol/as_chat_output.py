"""A chat completion's answer reshaped as another API's (OpenAI's Responses,
`responses_output.py`; Anthropic's Messages, `anthropic_output.py`): the part they share,
reading a chat stream's chunks into the pieces each API's events are made of. Pure: no I/O."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import orjson

from meshlm.common.errors import MeshError

Event = dict[str, Any]


class ReshapedAnswer(ABC):
    """One answer in another API's shapes: `whole` for a chat completion, or a stream's
    `start`, then `chunk` for each chat.completion.chunk, then `end` (or `failed`)."""

    def __init__(self) -> None:
        self._finish: str | None = None  # the chat's finish_reason
        self._usage: dict[str, Any] | None = None  # the chat's usage

    @abstractmethod
    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The API's answer to a chat completion (not streamed)."""

    @abstractmethod
    def start(self) -> list[Event]: ...

    @abstractmethod
    def end(self) -> list[Event]: ...

    @abstractmethod
    def failed(self, err: MeshError) -> list[Event]: ...

    def chunk(self, chunk: dict[str, Any]) -> list[Event]:
        """The events of one chat.completion.chunk."""
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events: list[Event] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                events += self._text(delta["content"], logprobs)
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    @abstractmethod
    def _reasoning(self, text: str) -> list[Event]: ...

    @abstractmethod
    def _text(self, text: str, logprobs: list[Any]) -> list[Event]: ...

    @abstractmethod
    def _call(self, call: dict[str, Any]) -> list[Event]:
        """A tool-call delta: its index, and its id and name (first) or arguments' text."""

    @staticmethod
    def sse(event: Event) -> bytes:
        """An SSE event named by its type."""
        return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
