"""Function calling on chat completions: OpenAI's `tools` and `tool_choice`. Pure: no I/O.

The tools go to the chat template (its `tools` variable, as Hugging Face's templates take
them). A forced call is constrained decoding, so every model answers in a form that parses,
whatever its own tool-call format:

- a named function (`{"type": "function", "function": {"name": ...}}`): the output is that
  function's arguments, a JSON object following its `parameters` schema;
- `"required"`: the output is a JSON array of one or more `{"name", "parameters"}` objects,
  each naming one of the tools and following its schema (one at most with
  `parallel_tool_calls: false`);
- `"none"`: the model answers in text.

`"auto"` (the default when tools are given) lets the model choose, in its own tool-call
format: the gateway serves it with a parser of that format (`--tool-call-parser`), and
refuses it (400) without one, as vLLM does without `--enable-auto-tool-choice`. The legacy
`functions` / `function_call` are refused. `forced_calls.py` and `tool_parsers.py` read the
output back as OpenAI's tool calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from meshlm.common.errors import invalid
from meshlm.gateway.protocol.json_body import JsonBody, show

MAX_TOOLS = 128  # OpenAI's limit on one request's tools
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_FORMS = ('give "none", "auto", "required", or {"type": "function", "function": {"name": '
          '...}}')



@dataclass(frozen=True)
class ToolChoice:
    """How a chat's answer may call its tools: one `named` function or "required" (one or
    more of them), forced by the output's JSON `schema`, or "auto" (`schema` None: the
    model's choice, read by a tool-call parser)."""

    tools: list[dict[str, Any]]  # as given, for the chat template
    named: str | None  # the function named by tool_choice; None: "required" or "auto"
    schema: dict[str, Any] | None
    schema_field: str  # the client's field the schema comes from (for its errors)

    @property
    def auto(self) -> bool:
        return self.schema is None


def parse_tools(b: JsonBody) -> tuple[list[dict[str, Any]] | None, ToolChoice | None]:
    """The request's tools (None: none given) and how the answer may call them (None: it
    may not)."""
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
        return tools, ToolChoice(tools, None, None, "tool_choice")
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


def checked_message_calls(message: dict[str, Any], path: str) -> None:
    """A chat message's tool-call fields, where given: an assistant's earlier `tool_calls`
    (a list of function calls, each with a name and its arguments as JSON text or an object)
    and a tool result's `tool_call_id`; templates read them as such."""
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise invalid(f"{path}.tool_calls", "must be a list of tool calls")
        for j, call in enumerate(calls):
            at = f"{path}.tool_calls[{j}]"
            if not isinstance(call, dict) or call.get("type", "function") != "function":
                raise invalid(at, 'must be a function call ({"type": "function", "function": '
                                  '{"name": ..., "arguments": ...}})')
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise invalid(f"{at}.function", "must be an object with a name")
            if not isinstance(function.get("arguments", ""), str | dict):
                raise invalid(f"{at}.function.arguments", "must be the arguments' JSON text "
                                                          "or an object")
            if not isinstance(call.get("id", ""), str):
                raise invalid(f"{at}.id", "must be a string")
    for key in ("tool_call_id", "name"):
        if not isinstance(message.get(key, ""), str):
            raise invalid(f"{path}.{key}", "must be a string")


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


def auto_refused() -> Exception:
    """tool_choice "auto" on a gateway without a tool-call parser."""
    return invalid("tool_choice", '"auto" (the default with tools) needs a parser of the '
                                  "model's own tool-call format, and this server has none "
                                  '(--tool-call-parser); give "none", "required" or a named '
                                  "function")
