"""A chat choice's output read as its parts: reasoning (`reasoning.py`, with a reasoning
parser), content, and tool calls (`tool_call_output.py`, with tools that may be called). The
reasoning comes first; what follows it is read for tool calls. Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshlm.gateway.protocol.reasoning import ReasoningReader
from meshlm.gateway.protocol.tool_call_output import CallReader


@dataclass
class Pieces:
    """What one stretch of output gave: reasoning text, content text, tool-call deltas."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __add__(self, other: Pieces) -> Pieces:
        return Pieces(self.reasoning + other.reasoning, self.content + other.content,
                      self.calls + other.calls)


class ChatOutput:
    """`thinking`: the reasoning parser's reader (None: no reasoning); `calls`: the tool-call
    reader (None: none); `keep_reasoning` false (vLLM's include_reasoning) drops the
    reasoning; `stream_reasoning` false (SGLang's) holds it until it is whole."""

    def __init__(self, thinking: ReasoningReader | None, calls: CallReader | None,
                 keep_reasoning: bool = True, stream_reasoning: bool = True) -> None:
        self._thinking = thinking
        self._calls = calls
        self._keep = keep_reasoning
        self._stream_reasoning = stream_reasoning
        self._held = ""  # reasoning not yet given (stream_reasoning false)

    def feed(self, text: str, last: bool) -> Pieces:
        reasoning, rest = self._thinking.feed(text, last) if self._thinking else ("", text)
        if not self._keep:
            reasoning = ""
        elif not self._stream_reasoning:
            self._held += reasoning
            reasoning = ""
            if self._held and (last or self._thinking is None or not self._thinking.thinking):
                reasoning, self._held = self._held, ""
        if self._calls is None:
            return Pieces(reasoning, rest)
        content, calls = self._calls.feed(rest, last)
        return Pieces(reasoning, content, calls)

    def reasoning(self) -> str | None:
        """All the reasoning (None: none, or not kept)."""
        if self._thinking is None or not self._keep:
            return None
        return "".join(self._thinking.reasoning) or None

    def content(self) -> str:
        if self._calls is not None:
            return self._calls.content()
        return "".join(self._thinking.content) if self._thinking else ""

    def tool_calls(self) -> list[dict[str, Any]]:
        return self._calls.calls() if self._calls is not None else []
