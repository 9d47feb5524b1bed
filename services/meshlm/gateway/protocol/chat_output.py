"""A chat choice's output read as its parts: reasoning (`reasoning.py`, with the gateway's
reasoning parser), content, and tool calls (`forced_calls.py` for a forced call,
`tool_parsers.py` for "auto" with the gateway's tool-call parser). The reasoning comes
first; what follows it is read for tool calls. `output_reader` picks the readers for a
request. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from meshlm.gateway.protocol.forced_calls import ForcedCalls
from meshlm.gateway.protocol.openai import ChatRequest
from meshlm.gateway.protocol.reasoning import PARSERS as REASONING_PARSERS
from meshlm.gateway.protocol.reasoning import ReasoningReader, tags
from meshlm.gateway.protocol.tool_call_output import CallReader, call_id
from meshlm.gateway.protocol.tool_calls import auto_refused
from meshlm.gateway.protocol.tool_parsers import CALL_IDS, PARSERS


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


def output_reader(req: ChatRequest, tool_call_parser: str, reasoning_parser: str
                  ) -> Callable[[], ChatOutput] | None:
    """What reads each choice's output as reasoning, content and tool calls, with the
    gateway's parsers (None: all of it is content)."""
    calls = call_reader(req, tool_call_parser)
    starts_in_thought = thinking(req, reasoning_parser)
    if calls is None and starts_in_thought is None:
        return None

    def output() -> ChatOutput:
        reader = (ReasoningReader(starts_in_thought, tags(reasoning_parser))
                  if starts_in_thought is not None else None)
        return ChatOutput(reader, calls() if calls else None, req.include_reasoning,
                          req.stream_reasoning)

    return output


def thinking(req: ChatRequest, reasoning_parser: str) -> bool | None:
    """Whether the chat's output starts in thought (None: its thinking is not read apart:
    no reasoning parser, or SGLang's separate_reasoning false). A JSON constraint (a forced
    call, response_format, ...) comes after the thinking (`json_after_thinking`); a regex, a
    grammar or a choice describes the whole output, so it is in thought only where it
    starts with <think>."""
    if not req.separate_reasoning:
        return None
    mode = REASONING_PARSERS.get(reasoning_parser)
    if mode is None:
        return None
    starts_in_thought = bool(req.template_kwargs.get(mode)) if isinstance(mode, str) else mode
    if starts_in_thought and req.sampling.HasField("guided_decoding") and not (
            json_after_thinking(req)):
        return False
    return starts_in_thought


def json_after_thinking(req: ChatRequest) -> bool:
    """Whether the chat's constraint is a JSON schema: with a reasoning parser, the model
    thinks first and the JSON follows its </think> (`constraints.think_first`), as vLLM
    applies structured outputs once the reasoning ends."""
    return req.sampling.guided_decoding.WhichOneof("constraint") == "json_schema"


def call_reader(req: ChatRequest, parser: str) -> Callable[[], CallReader] | None:
    """What reads the chat's output as tool calls (None: text only). "auto" takes the
    server's parser of the model's own format (refused without one); the parser's tags must
    survive detokenization, so the output keeps special tokens unless the client said
    otherwise (some tokenizers mark <tool_call> special)."""
    choice = req.tool_choice
    if choice is None:
        return None
    if not choice.auto:
        return partial(ForcedCalls, choice.named, CALL_IDS.get(parser, call_id))
    if parser not in PARSERS:
        raise auto_refused()
    if not req.sampling.HasField("skip_special_tokens"):
        req.sampling.skip_special_tokens = False
    reader = PARSERS[parser]
    if reader.NEEDS_TOOLS:  # it reads the tools' parameter types
        return partial(cast(Callable[..., CallReader], reader), tools=req.tools)
    return reader
