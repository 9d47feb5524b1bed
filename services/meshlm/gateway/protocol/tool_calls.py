"""Function calling on chat completions: OpenAI's `tools` and `tool_choice`. Pure: no I/O.

The tools go to the chat template (its `tools` variable, as Hugging Face's templates take
them). A call is forced by constrained decoding, so every model answers in a form that
parses, whatever its own tool-call format:

- a named function (`{"type": "function", "function": {"name": ...}}`): the output is that
  function's arguments, a JSON object following its `parameters` schema;
- `"required"`: the output is a JSON array of one or more `{"name", "parameters"}` objects,
  each naming one of the tools and following its schema (one at most with
  `parallel_tool_calls: false`);
- `"none"`: the model answers in text.

`"auto"` (the default when tools are given) needs a parser of the model's own tool-call
format, which meshlm does not have: it is refused (400) as vLLM refuses it without
`--enable-auto-tool-choice`. The legacy `functions` / `function_call` are refused too.

`ToolCallScanner` reads the constrained output as it streams and yields OpenAI's tool-call
deltas: a call's id, type and name once its name is complete, then its arguments' text as
it comes. The whole answer's `tool_calls` are the same calls, so a stream and a whole reply
agree, also when the output was cut short by max_tokens (the last call's arguments are then
incomplete, and finish_reason says "length").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from meshlm.common.errors import invalid
from meshlm.gateway.protocol.json_body import JsonBody, show

MAX_TOOLS = 128  # OpenAI's limit on one request's tools
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_FORMS = 'give "none", "required", or {"type": "function", "function": {"name": ...}}'

Delta = dict[str, Any]


@dataclass(frozen=True)
class ToolChoice:
    """How a chat's answer calls its tools: one `named` function, or `required` (one or more
    of them); the output's JSON schema forces it."""

    tools: list[dict[str, Any]]  # as given, for the chat template
    named: str | None  # the function named by tool_choice; None: "required"
    schema: dict[str, Any]
    schema_field: str  # the client's field the schema comes from (for its errors)


def parse_tools(b: JsonBody) -> tuple[list[dict[str, Any]] | None, ToolChoice | None]:
    """The request's tools (None: none given) and, when a call is forced, how."""
    for key in ("functions", "function_call"):
        if b.get(key) is not None:
            raise invalid(key, "is not supported (OpenAI's deprecated form); use tools and "
                               "tool_choice")
    tools = checked_tools(b.get("tools"))
    choice = b.get("tool_choice")
    parallel = b.boolean("parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none", "auto"):  # none and auto without tools: no calls
            raise invalid("tool_choice", "needs tools")
        return None, None
    if choice is None or choice == "auto":
        raise invalid("tool_choice", '"auto" (the default with tools) is not supported: it '
                                     "needs a parser of the model's own tool-call format; "
                                     + _FORMS)
    if choice == "none":
        return tools, None
    names = [t["function"]["name"] for t in tools]
    if choice == "required":
        return tools, ToolChoice(tools, None, _required_schema(tools, parallel is not False),
                                 "tools")
    name = _named(choice)
    if name not in names:
        raise invalid("tool_choice.function.name", f"{show(name)} is not one of the tools "
                                                   f"({', '.join(names)})")
    i = names.index(name)
    return tools, ToolChoice(tools, name, _parameters(tools[i]["function"]),
                             f"tools[{i}].function.parameters")


def checked_tools(value: Any) -> list[dict[str, Any]] | None:
    """OpenAI's tools (None: not given); INVALID_ARGUMENT naming what is wrong."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise invalid("tools", "must be a non-empty list of tools; leave it out for none")
    if len(value) > MAX_TOOLS:
        raise invalid("tools", f"at most {MAX_TOOLS} tools, got {len(value)}")
    seen: set[str] = set()
    for i, tool in enumerate(value):
        path = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise invalid(f"{path}.type", 'only function tools ({"type": "function", '
                                          '"function": {...}}) are supported')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{path}.function", "must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid(f"{path}.function.name", "must be 1 to 64 letters, digits, _ or -, "
                                                   f"got {show(name)}")
        if name in seen:
            raise invalid(f"{path}.function.name", f"{name!r} names two tools")
        seen.add(name)
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise invalid(f"{path}.function.{key}", f"must be {_KINDS[kind]}")
    return value


_KINDS = {str: "a string", dict: "a JSON schema object", bool: "true or false"}


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or choice.get("type", "function") != "function":
        raise invalid("tool_choice", f"{_FORMS}; got {show(choice)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("tool_choice.function.name", "must name one of the tools")
    return name


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if parameters is not None else _NO_PARAMETERS


def _required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """"required"'s array of calls: each element one function's name, then its arguments.
    Each tool's parameters move under the array schema's $defs (as "meshlm_tool<i>", its own
    $defs or definitions as "meshlm_tool<i>.<name>"), and their local references with them,
    so that two tools' definitions cannot clash and "#/..." still means their own root."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        root = f"meshlm_tool{i}"
        parameters = _parameters(function)
        for key in ("$defs", "definitions"):
            named = parameters.get(key)
            if isinstance(named, dict):
                defs.update({f"{root}.{name}": _rebased(sub, root) for name, sub in named.items()})
        defs[root] = _rebased({k: v for k, v in parameters.items()
                               if k not in ("$defs", "definitions", "$schema", "$id")}, root)
        items.append({"type": "object",
                      "properties": {"name": {"const": function["name"]},
                                     "parameters": {"$ref": f"#/$defs/{root}"}},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items},
                              "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rebased(schema: Any, root: str) -> Any:
    """`schema` with its local references ("#...") pointing where `_required_schema` put
    their targets."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            pointer = value[1:]
            for defs in ("/$defs/", "/definitions/"):
                if pointer.startswith(defs):
                    pointer = "." + pointer[len(defs):]
                    break
            out[key] = f"#/$defs/{root}{pointer}"
        else:
            out[key] = _rebased(value, root)
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the arguments of earlier tool calls as objects where they are JSON
    objects, as chat templates read them (OpenAI sends them as JSON text)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list) and any(_text_arguments(c) for c in calls):
            message = {**message, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(message)
    return out


def _text_arguments(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("arguments"), str)


def _with_object_arguments(call: Any) -> Any:
    if not _text_arguments(call):
        return call
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**call["function"], "arguments": arguments}}


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ---- reading the output ----------------------------------------------------------------------


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ToolCallScanner:
    """One choice's constrained output, read as it comes: `feed` returns the tool-call
    deltas it completes (OpenAI's `delta.tool_calls` entries); `calls` is every call so far,
    as a reply's `message.tool_calls`."""

    def __init__(self, named: str | None) -> None:
        self._calls: list[_Call] = []
        self._named = named
        self._array = _ArrayReader() if named is None else None

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        if self._array is None:  # a named function: the whole output is its arguments
            if not self._calls:
                assert self._named is not None
                self._calls.append(_Call(call_id(), self._named, [text]))
                return [self._opening(0, text)]
            self._calls[0].arguments.append(text)
            return [{"index": 0, "function": {"arguments": text}}]
        deltas: list[Delta] = []
        for event, value in self._array.feed(text):
            if event == "name":
                self._calls.append(_Call(call_id(), value))
                deltas.append(self._opening(len(self._calls) - 1, ""))
            elif self._calls:  # arguments' text of the last call
                self._calls[-1].arguments.append(value)
                if deltas and deltas[-1]["index"] == len(self._calls) - 1:
                    deltas[-1]["function"]["arguments"] += value
                else:
                    deltas.append({"index": len(self._calls) - 1,
                                   "function": {"arguments": value}})
        return deltas

    def calls(self) -> list[Delta]:
        return [{"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": "".join(c.arguments)}}
                for c in self._calls]

    def _opening(self, index: int, arguments: str) -> Delta:
        call = self._calls[index]
        return {"index": index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": arguments}}


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
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False
            try:
                self._read_key = json.loads('"' + "".join(self._key) + '"')
            except ValueError:
                self._read_key = ""
            self._key, self._started = None, False
            return
        self._key.append(ch)

    def _track(self, ch: str) -> None:
        """Strings and nesting, outside keys."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1

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
