"""The answer to a Responses request (`responses.py`) in the Responses API's shapes, from the
chat completion it was served as: a Response object whose `output` holds a `reasoning` item
(with the gateway's reasoning parser), a `message` with the `output_text`, and a
`function_call` item per tool call; streamed, the API's events (`response.created`, an
item's `added`, its text's `delta`s and `done`, ..., `response.completed`, or
`response.incomplete` when max_output_tokens cut it), each an SSE event named by its type
and numbered. Pure: no I/O."""

from __future__ import annotations

import uuid
from typing import Any

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol.as_chat_output import Event, ReshapedAnswer
from meshlm.gateway.protocol.openai_errors import error_body


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShape(ReshapedAnswer):
    """One response: its id, its request's echoed fields, and its output items as they come."""

    def __init__(self, echo: dict[str, Any], created: int) -> None:
        super().__init__()
        self.id = _id("resp")
        self._echo = echo
        self._created = created
        self._model = ""
        self.items: list[dict[str, Any]] = []  # output items, in order
        self._texts: dict[int, list[str]] = {}  # an item's text (or arguments) so far
        self._logprobs: dict[int, list[Any]] = {}  # a message item's logprobs
        self._open: tuple[str, int] | None = None  # (kind, call index) of the open item
        self._seq = 0

    # ---- a whole answer ----------------------------------------------------------------------

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response object of a chat completion (not streamed)."""
        self._model = chat.get("model", "")
        self._usage = chat.get("usage")
        [choice] = chat["choices"]
        message = choice["message"]
        self._finish = choice.get("finish_reason")
        if message.get("reasoning_content"):
            self._add("reasoning", message["reasoning_content"])
        content = message.get("content")
        if content or not message.get("tool_calls"):
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            self._add("message", content or "", logprobs)
        for call in message.get("tool_calls") or []:
            self._add("function_call", call["function"]["arguments"],
                      name=call["function"]["name"], call_id=call["id"])
        for item in self.items:
            self._close_item(item)
        return self._response()

    # ---- a stream ----------------------------------------------------------------------------

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def _reasoning(self, text: str) -> list[Event]:
        return self._delta("reasoning", text)

    def _text(self, text: str, logprobs: list[Any]) -> list[Event]:
        return self._delta("message", text, logprobs)

    def end(self) -> list[Event]:
        """The open item's end, then the response's."""
        events = self._close()
        if not self.items:  # an answer with no output at all: an empty message
            self._add("message", "")
            self._open = ("message", -1)
            events += self._opened(0)
            events += self._close()
        response = self._response()
        kind = "response.incomplete" if response["status"] == "incomplete" else \
            "response.completed"
        return events + [self._event(kind, response=response)]

    def failed(self, err: MeshError) -> list[Event]:
        """A failure during the stream: OpenAI's error event, then the failed response."""
        body = error_body(err)["error"]
        response = self._response("failed")
        response["error"] = {"code": body["code"], "message": body["message"]}
        return [self._event("error", code=body["code"], message=body["message"],
                            param=body["param"]),
                self._event("response.failed", response=response)]

    # ---- items -------------------------------------------------------------------------------

    def _delta(self, kind: str, text: str, logprobs: list[Any] | None = None) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open[0] != kind:
            events += self._close()
            self._add(kind, "")
            self._open = (kind, -1)
            events += self._opened(len(self.items) - 1)
        index = len(self.items) - 1
        self._texts[index].append(text)
        item_id = self.items[index]["id"]
        if kind == "message":
            self._logprobs[index] += logprobs or []
            events.append(self._event("response.output_text.delta", item_id=item_id,
                                      output_index=index, content_index=0, delta=text,
                                      logprobs=logprobs or []))
        else:
            events.append(self._event("response.reasoning_text.delta", item_id=item_id,
                                      output_index=index, content_index=0, delta=text))
        return events

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        function = call.get("function") or {}
        if self._open != ("function_call", call["index"]):
            events += self._close()
            self._add("function_call", "", name=function.get("name", ""),
                      call_id=call.get("id", ""))
            self._open = ("function_call", call["index"])
            events += self._opened(len(self.items) - 1)
        index = len(self.items) - 1
        if arguments := function.get("arguments"):
            self._texts[index].append(arguments)
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self.items[index]["id"], output_index=index,
                                      delta=arguments))
        return events

    def _add(self, kind: str, text: str, logprobs: list[Any] | None = None, **fields: str
             ) -> None:
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item: dict[str, Any] = {"id": _id(prefix), "type": kind, "status": "in_progress"}
        if kind == "message":
            item.update(role="assistant", content=[])
        elif kind == "reasoning":
            item.update(summary=[], content=[])
        else:
            item.update(call_id=fields["call_id"], name=fields["name"], arguments="")
        self._texts[len(self.items)] = [text] if text else []
        self._logprobs[len(self.items)] = list(logprobs or [])
        self.items.append(item)

    def _opened(self, index: int) -> list[Event]:
        item = self.items[index]
        events = [self._event("response.output_item.added", output_index=index,
                              item=dict(item))]
        if item["type"] != "function_call":
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      part=self._part(item["type"], "", [])))
        return events

    def _close(self) -> list[Event]:
        """The open item's done events."""
        if self._open is None:
            return []
        self._open = None
        index = len(self.items) - 1
        item = self.items[index]
        self._close_item(item)
        text = "".join(self._texts[index])
        if item["type"] == "function_call":
            return [self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, name=item["name"], arguments=text),
                    self._event("response.output_item.done", output_index=index, item=item)]
        if item["type"] == "message":
            done = self._event("response.output_text.done", item_id=item["id"],
                               output_index=index, content_index=0, text=text,
                               logprobs=self._logprobs[index])
        else:
            done = self._event("response.reasoning_text.done", item_id=item["id"],
                               output_index=index, content_index=0, text=text)
        return [done,
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=item["content"][0]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _close_item(self, item: dict[str, Any]) -> None:
        index = self.items.index(item)
        text = "".join(self._texts[index])
        item["status"] = "incomplete" if self._finish == "length" else "completed"
        if item["type"] == "function_call":
            item["arguments"] = text
        else:
            item["content"] = [self._part(item["type"], text, self._logprobs[index])]

    @staticmethod
    def _part(kind: str, text: str, logprobs: list[Any]) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    # ---- the response ------------------------------------------------------------------------

    def _response(self, status: str | None = None) -> dict[str, Any]:
        if status is None:
            status = "incomplete" if self._finish == "length" else "completed"
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id, "object": "response", "created_at": self._created,
            "status": status, "model": self._model, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "output": [dict(i) for i in self.items] if done else [],
            **self._echo,
            "usage": self._usage_of() if done else None,
        }

    def _usage_of(self) -> dict[str, Any] | None:
        usage = self._usage
        if usage is None:
            return None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event
