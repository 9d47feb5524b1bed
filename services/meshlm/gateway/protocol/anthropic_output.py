"""The answer to a Messages request (`anthropic.py`) in Anthropic's shapes, from the chat
completion it was served as: a message whose `content` holds a `thinking` block (with the
gateway's reasoning parser), a `text` block and a `tool_use` block per call, with its
`stop_reason` (end_turn, max_tokens, tool_use) and usage; streamed, Anthropic's events
(`message_start`, each block's `content_block_start`, its `text_delta`, `thinking_delta` or
`input_json_delta`s and `content_block_stop`, then `message_delta` and `message_stop`). A
failure is Anthropic's error object. Pure: no I/O."""

from __future__ import annotations

import json
import uuid
from typing import Any

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol.as_chat_output import Event, ReshapedAnswer

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def error_object(err: MeshError, status: int) -> dict[str, Any]:
    """Anthropic's error body."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class MessageShape(ReshapedAnswer):
    """One message: its id and model, and its content blocks as they come."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.id = f"msg_{uuid.uuid4().hex}"
        self._model = model
        self.blocks: list[dict[str, Any]] = []
        self._open: tuple[str, int] | None = None  # (kind, call index) of the open block

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The message of a chat completion (not streamed)."""
        self._usage = chat.get("usage") or {}
        [choice] = chat["choices"]
        self._finish = choice.get("finish_reason")
        message = choice["message"]
        if message.get("reasoning_content"):
            self.blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                                "signature": ""})
        if message.get("content"):
            self.blocks.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            self.blocks.append({"type": "tool_use", "id": call["id"],
                                "name": call["function"]["name"],
                                "input": _input(call["function"]["arguments"])})
        return self._message(done=True)

    def start(self) -> list[Event]:
        return [{"type": "message_start", "message": self._message(done=False)}]

    def _reasoning(self, text: str) -> list[Event]:
        return self._delta("thinking", {"type": "thinking_delta", "thinking": text})

    def _text(self, text: str, logprobs: list[Any]) -> list[Event]:
        return self._delta("text", {"type": "text_delta", "text": text})

    def end(self) -> list[Event]:
        return self._close() + [
            {"type": "message_delta",
             "delta": {"stop_reason": self._stop_reason(), "stop_sequence": None},
             "usage": self._usage_of()},
            {"type": "message_stop"}]

    def failed(self, err: MeshError) -> list[Event]:
        return [error_object(err, err.http_status)]

    # ---- blocks ------------------------------------------------------------------------------

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open[0] != kind:
            events += self._close()
            block: dict[str, Any] = ({"type": "text", "text": ""} if kind == "text"
                                     else {"type": "thinking", "thinking": "", "signature": ""})
            events += self._opened(kind, -1, block)
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1,
                          "delta": delta}]

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        function = call.get("function") or {}
        if self._open != ("tool_use", call["index"]):
            events += self._close()
            events += self._opened("tool_use", call["index"], {
                "type": "tool_use", "id": call.get("id", ""), "name": function.get("name", ""),
                "input": {}})
        if arguments := function.get("arguments"):
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def _opened(self, kind: str, call: int, block: dict[str, Any]) -> list[Event]:
        self._open = (kind, call)
        self.blocks.append(block)
        return [{"type": "content_block_start", "index": len(self.blocks) - 1,
                 "content_block": block}]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    # ---- the message -------------------------------------------------------------------------

    def _message(self, done: bool) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self._model,
                "content": self.blocks if done else [],
                "stop_reason": self._stop_reason() if done else None, "stop_sequence": None,
                "usage": self._usage_of()}

    def _stop_reason(self) -> str:
        return _STOP_REASONS.get(self._finish or "", "end_turn")

    def _usage_of(self) -> dict[str, Any]:
        usage = self._usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": usage.get("prompt_tokens", 0),
                "output_tokens": usage.get("completion_tokens", 0),
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _input(arguments: str) -> Any:
    """A call's arguments as the object Anthropic's tool_use carries (their text, when it is
    not JSON: a call cut by max_tokens)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
