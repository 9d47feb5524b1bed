"""Reading a chat's output as OpenAI tool calls: as it streams (each reader's `feed` returns
the content and the tool-call deltas it completes) and whole (`calls`, `content`), from the
same reader, so a stream and a whole reply agree.

- `ForcedCalls`: the output a forced call was constrained to (`tool_calls.py`): a named
  function's arguments, or "required"'s JSON array of `{"name", "parameters"}` calls. A
  call's first delta (its index, id, type and name) comes once its name is complete, then
  its arguments' text as it comes.
- `HermesCalls` (`--tool-call-parser hermes`, or SGLang's name `qwen25`; for tool_choice
  "auto"): the model's own `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (Hermes 2 Pro and later, Qwen2.5 and Qwen3), any text before and between them being
  content. A block is one delta when it closes; text that may begin a tag is held until it
  is clear. A block that does not hold such JSON stays content, as written.
- `JsonCalls` (`llama3_json`, `llama4_json`, SGLang's `llama3`): Llama 3.1 and later's JSON
  calls, an output that starts with `<|python_tag|>` or `{` being `{"name", "parameters"}`
  objects separated by `;`, each one delta when complete.
- `PythonicCalls` (`pythonic`): Llama 3.2 and 4's `[f(a=1), g(b="x")]`, read whole at the
  end of the output.

Output cut short by max_tokens gives the calls so far, the last one's arguments incomplete.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from meshlm.gateway.protocol.text_tags import partial_tag

Delta = dict[str, Any]


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class _Call:
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

    def __init__(self) -> None:
        self._calls: list[_Call] = []
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


class ForcedCalls(CallReader):
    """A forced call's output: `named`'s arguments, or (None) "required"'s array."""

    def __init__(self, named: str | None) -> None:
        super().__init__()
        self._named = named
        self._array = _ArrayReader() if named is None else None

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        if not text:
            return "", []
        if self._array is None:  # a named function: the whole output is its arguments
            if not self._calls:
                assert self._named is not None
                self._calls.append(_Call(call_id(), self._named, [text]))
                return "", [self._calls[0].opening(0, text)]
            self._calls[0].arguments.append(text)
            return "", [{"index": 0, "function": {"arguments": text}}]
        deltas: list[Delta] = []
        for event, value in self._array.feed(text):
            if event == "name":
                self._calls.append(_Call(call_id(), value))
                deltas.append(self._calls[-1].opening(len(self._calls) - 1, ""))
            elif self._calls:  # arguments' text of the last call
                index = len(self._calls) - 1
                self._calls[index].arguments.append(value)
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += value
                else:
                    deltas.append({"index": index, "function": {"arguments": value}})
        return "", deltas


class HermesCalls(CallReader):
    """`<tool_call>{json}</tool_call>` blocks among content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # not yet read as content or a call
        self._in_call = False

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        self._pending += text
        content: list[str] = []
        deltas: list[Delta] = []
        while True:
            tag = self.CLOSE if self._in_call else self.OPEN
            at = self._pending.find(tag)
            if at < 0:
                break
            before, self._pending = self._pending[:at], self._pending[at + len(tag):]
            if self._in_call:
                self._block(before, content, deltas, closed=True)
            elif before:
                content.append(before)
            self._in_call = not self._in_call
        if last:
            if self._in_call:
                self._block(self._pending, content, deltas, closed=False)
            elif self._pending:
                content.append(self._pending)
            self._pending, self._in_call = "", False
        elif not self._in_call:  # content up to what may begin a tag
            keep = partial_tag(self._pending, self.OPEN)
            if len(self._pending) > keep:
                content.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
        text_out = "".join(content)
        self._content.append(text_out)
        return text_out, deltas

    def _block(self, body: str, content: list[str], deltas: list[Delta], closed: bool) -> None:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get("arguments", call.get("parameters", {})) if name else None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            content.append(self.OPEN + body + (self.CLOSE if closed else ""))
            return
        self._calls.append(_Call(call_id(), name, [json.dumps(arguments, ensure_ascii=False)]))
        deltas.append(self._calls[-1].opening(len(self._calls) - 1,
                                              self._calls[-1].arguments[0]))


class JsonCalls(CallReader):
    """Llama 3.1+'s JSON tool calls: an output that starts with `<|python_tag|>` or `{` is
    calls, `{"name": ..., "parameters": {...}}` objects one after another (`;` between them);
    any other output is content. Each call is one delta once its object is complete; what
    does not read as calls by the end is content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._calls_mode: bool | None = None  # undecided until the output's start is seen

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        self._pending += text
        if self._calls_mode is None:
            start = self._pending.lstrip()
            if not last and (not start or (self.TAG.startswith(start) and start != self.TAG)):
                return "", []  # not yet clear
            self._calls_mode = start.startswith((self.TAG, "{"))
            if self._calls_mode:
                self._pending = start.removeprefix(self.TAG)
        if not self._calls_mode:
            content, self._pending = self._pending, ""
            self._content.append(content)
            return content, []
        deltas = self._complete_calls()
        content = ""
        if last and self._pending.strip():  # not calls after all: the rest is content
            content, self._pending = self._pending, ""
            self._content.append(content)
        return content, deltas

    def _complete_calls(self) -> list[Delta]:
        deltas: list[Delta] = []
        decoder = json.JSONDecoder()
        while True:
            start = len(self._pending) - len(self._pending.lstrip(" \t\n;"))
            try:
                call, end = decoder.raw_decode(self._pending, start)
            except ValueError:  # incomplete so far (or not JSON: content at the end)
                return deltas
            name = call.get("name") if isinstance(call, dict) else None
            arguments = call.get("parameters", call.get("arguments")) if name else None
            if not isinstance(name, str) or not isinstance(arguments, dict):
                return deltas
            self._pending = self._pending[end:]
            self._calls.append(_Call(call_id(), name,
                                     [json.dumps(arguments, ensure_ascii=False)]))
            deltas.append(self._calls[-1].opening(len(self._calls) - 1,
                                                  self._calls[-1].arguments[0]))


class PythonicCalls(CallReader):
    """Calls written as a Python list of calls with keyword arguments,
    `[get_weather(city="Paris"), get_time(zone="UTC")]` (Llama 3.2 and 4's pythonic form): an
    output that starts with `[` is held to its end and read as such a list (each argument a
    Python literal, given as JSON); any other output, or one that does not read so, is
    content."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._calls_mode: bool | None = None

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        self._pending += text
        if self._calls_mode is None:
            start = self._pending.lstrip()
            if not start and not last:
                return "", []
            self._calls_mode = start.startswith("[")
        if self._calls_mode and not last:
            return "", []
        text_out, self._pending = self._pending, ""
        calls = _python_calls(text_out) if self._calls_mode else None
        if calls is None:
            self._content.append(text_out)
            return text_out, []
        deltas = []
        for name, arguments in calls:
            self._calls.append(_Call(call_id(), name, [json.dumps(arguments, ensure_ascii=False)]))
            deltas.append(self._calls[-1].opening(len(self._calls) - 1,
                                                  self._calls[-1].arguments[0]))
        return "", deltas


def _python_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """`[f(a=1), g(b="x")]` as (name, arguments) pairs; None when it is not such a list."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and not node.args and all(k.arg for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            json.dumps(arguments)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append((node.func.id, arguments))
    return calls


# --tool-call-parser's names: vLLM's, and SGLang's for the same formats.
PARSERS: dict[str, type[CallReader]] = {"hermes": HermesCalls, "qwen25": HermesCalls,
                                        "llama3_json": JsonCalls, "llama4_json": JsonCalls,
                                        "llama3": JsonCalls, "pythonic": PythonicCalls}


class _ArrayReader:
    """Reads `[{"name": <string>, "parameters": <value>}, ...]` character by character (any
    whitespace, keys in any order within an element) and reports ("name", the name) when an
    element's name is complete and ("arguments", text) for the text of its parameters' value
    as it arrives (held until the element's name is known)."""

    def __init__(self) -> None:
        self._depth = 0  # of [ and { outside strings: 1 in the array, 2 in an element
        self._in_string = False
        self._escaped = False
        self._key: list[str] | None = None  # an element's key, while it is read
        self._read_key: str | None = None  # the key read, until its ":"
        self._value_key = ""  # the key whose value is being read ("" between values)
        self._name: list[str] = []  # the name's JSON text
        self._started = False  # the parameters' value has begun
        self._named = False  # the current element's name was reported
        self._held: list[str] = []  # parameters' text before the element's name

    def feed(self, text: str) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        for ch in text:
            self._step(ch, events)
        merged: list[tuple[str, str]] = []
        for event in events:  # one ("arguments", text) for adjacent ones
            if merged and event[0] == merged[-1][0] == "arguments":
                merged[-1] = ("arguments", merged[-1][1] + event[1])
            else:
                merged.append(event)
        return merged

    def _step(self, ch: str, events: list[tuple[str, str]]) -> None:
        in_element = self._depth == 2 and not self._in_string
        if self._value_key:
            if not (in_element and ch in ",}"):  # the value goes on
                self._value_char(ch, events)
                return
            if self._value_key == "name":  # the value ends here
                self._name_done(events)
            self._value_key = ""
        if self._key is not None:
            self._key_char(ch)
        elif in_element and ch == '"':
            self._key, self._in_string = [], True
        elif in_element and ch == ":" and self._read_key is not None:
            self._value_key, self._read_key, self._name = self._read_key, None, []
        else:
            self._track(ch)
            if ch == "{" and self._depth == 2:  # a new element
                self._named, self._held = False, []

    def _value_char(self, ch: str, events: list[tuple[str, str]]) -> None:
        started = bool(self._name) if self._value_key == "name" else self._started
        if not started and ch.isspace():
            return
        if self._value_key == "name":
            self._name.append(ch)
        elif self._value_key == "parameters":
            self._started = True
            if self._named:
                events.append(("arguments", ch))
            else:
                self._held.append(ch)
        self._track(ch)

    def _key_char(self, ch: str) -> None:
        assert self._key is not None
        self._string_char(ch)
        if self._in_string:
            self._key.append(ch)
            return
        try:  # the closing quote
            self._read_key = json.loads('"' + "".join(self._key) + '"')
        except ValueError:
            self._read_key = ""
        self._key, self._started = None, False

    def _track(self, ch: str) -> None:
        """Strings and nesting, outside keys."""
        if self._in_string:
            self._string_char(ch)
        elif ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1

    def _string_char(self, ch: str) -> None:
        """One character in a string: escapes, and the closing quote."""
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False

    def _name_done(self, events: list[tuple[str, str]]) -> None:
        try:
            name = json.loads("".join(self._name))
        except ValueError:
            return
        if isinstance(name, str) and not self._named:
            self._named = True
            events.append(("name", name))
            if self._held:
                events.append(("arguments", "".join(self._held)))
                self._held = []
