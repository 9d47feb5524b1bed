"""Reading a chat's output as OpenAI tool calls: the readers' common part. A reader's `feed`
returns the content and the tool-call deltas a stretch of output completes (a call's first
delta has its index, id, type and name); `calls` and `content` are the whole reply's, from
the same reader, so a stream and a whole reply agree. The readers: `forced_calls.py` (the
output a forced call was constrained to) and `tool_parsers.py` (the model's own formats,
for tool_choice "auto"); `call_scanner.py` reads JSON calls as they stream for both.
Output cut short by max_tokens gives the calls so far."""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshlm.gateway.protocol.call_scanner import Event

Delta = dict[str, Any]


IdMaker = Callable[[str, int], str]  # a call's id, from its name and its place in the reply


def call_id(name: str = "", index: int = 0) -> str:
    return "call_" + uuid.uuid4().hex[:24]


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id(name: str = "", index: int = 0) -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other tool call id when
    the call comes back in the next turn's messages."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def kimi_call_id(name: str, index: int) -> str:
    """`functions.NAME:INDEX`: Kimi K2's chat template writes an earlier call's id back as the
    head its model reads a call by."""
    return f"functions.{name}:{index}"


@dataclass
class Call:
    """One tool call being read: its arguments' text as it came."""

    id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    def whole(self) -> Delta:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": "".join(self.arguments)}}

    def opening(self, index: int, arguments: str) -> Delta:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": arguments}}


class CallReader:
    """One choice's output, read as tool calls and content."""

    NEEDS_TOOLS = False  # whether it is built with the request's tools (`chat_output`)

    def __init__(self, new_id: IdMaker = call_id) -> None:
        self._new_id = new_id  # each call's id
        self._calls: list[Call] = []
        self._content: list[str] = []

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        """The content and the tool-call deltas that `text` completes (`last`: the output
        ends with it)."""
        raise NotImplementedError

    def calls(self) -> list[Delta]:
        """Every call so far, as a reply's `message.tool_calls`."""
        return [c.whole() for c in self._calls]

    def content(self) -> str:
        return "".join(self._content)

    def _called(self, name: str, arguments: str) -> Delta:
        """A whole call read: kept, and its one delta."""
        self._calls.append(Call(self._new_id(name, len(self._calls)), name, [arguments]))
        return self._calls[-1].opening(len(self._calls) - 1, arguments)

    def _take(self, events: list[Event], deltas: list[Delta]) -> None:
        """A call scanner's events as calls and their deltas: a call opens with its name,
        its arguments' text follows (one delta a call per stretch of output)."""
        for event, value in events:
            if event == "name":
                self._open(value, deltas)
            elif self._calls:  # arguments' text of the last call
                self._arguments(value, deltas)

    def _open(self, name: str, deltas: list[Delta], id_: str = "") -> None:
        """A new call, named: its first delta (its arguments follow)."""
        self._calls.append(Call(id_ or self._new_id(name, len(self._calls)), name))
        deltas.append(self._calls[-1].opening(len(self._calls) - 1, ""))

    def _arguments(self, text: str, deltas: list[Delta]) -> None:
        """More of the last call's arguments."""
        index = len(self._calls) - 1
        self._calls[index].arguments.append(text)
        if deltas and deltas[-1]["index"] == index:
            deltas[-1]["function"]["arguments"] += text
        else:
            deltas.append({"index": index, "function": {"arguments": text}})
