"""The models' own tool-call formats, read for tool_choice "auto" (the gateway's
`--tool-call-parser`; vLLM's names, and SGLang's for the same formats):

- `HermesCalls` (`hermes`, SGLang's `qwen25`): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks (Hermes 2 Pro and later, Qwen2.5 and Qwen3), any text before
  and between them being content. A block is one delta when it closes; text that may begin
  a tag is held until it is clear. A block that does not hold such JSON stays content.
- `JsonCalls` (`llama3_json`, `llama4_json`, SGLang's `llama3`): Llama 3.1 and later's JSON
  calls, an output that starts with `<|python_tag|>` or `{` being `{"name", "parameters"}`
  objects separated by `;`, each one delta when complete.
- `PythonicCalls` (`pythonic`): Llama 3.2 and 4's `[f(a=1), g(b="x")]`, read whole at the
  end of the output.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from meshlm.gateway.protocol.text_tags import partial_tag
from meshlm.gateway.protocol.tool_call_output import CallReader, Delta


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
        if text_out:
            self._content.append(text_out)
        return text_out, deltas

    def _block(self, body: str, content: list[str], deltas: list[Delta], closed: bool) -> None:
        try:
            call = _json_call(json.loads(body), ("arguments", "parameters"), required=False)
        except ValueError:
            call = None
        if call is None:
            content.append(self.OPEN + body + (self.CLOSE if closed else ""))
            return
        deltas.append(self._called(*call))


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
            read = _json_call(call, ("parameters", "arguments"), required=True)
            if read is None:
                return deltas
            self._pending = self._pending[end:]
            deltas.append(self._called(*read))


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
        return "", [self._called(name, json.dumps(arguments, ensure_ascii=False))
                    for name, arguments in calls]


def _json_call(doc: Any, keys: tuple[str, str], required: bool) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call written as a JSON object with a "name" and its
    arguments under one of `keys` (an object, or its JSON text; absent: none, unless
    `required`); None when `doc` is not such a call."""
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        return None
    given = [doc[key] for key in keys if key in doc]
    if not given and required:
        return None
    arguments = given[0] if given else {}
    if isinstance(arguments, str):  # some models write the arguments' JSON as a string
        try:
            as_object = json.loads(arguments)
        except ValueError:
            return None
        return (doc["name"], arguments) if isinstance(as_object, dict) else None
    if not isinstance(arguments, dict):
        return None
    return doc["name"], json.dumps(arguments, ensure_ascii=False)


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
