"""Tool calls whose arguments are tagged parameters, one value each, read for tool_choice
"auto" (the gateway's `--tool-call-parser`; vLLM's and SGLang's names):

- `Qwen3CoderCalls` (`qwen3_coder`: Qwen3-Coder and the Qwen3.5 family):
  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`;
- `Glm45Calls` (`glm45`, also `glm47`: GLM-4.5 and later):
  `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>`.

A value is raw text; it becomes JSON by its parameter's type in the request's tools (a string
stays text; an integer, number, boolean, object or array is read as JSON, else as a Python
literal; what reads as neither stays a string; a parameter the tools do not describe is read
as JSON where it can be). A call opens once its name is complete, and its arguments follow one
parameter at a time, as each one closes, so a stream and a whole reply agree.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from meshlm.gateway.protocol.block_calls import BlockCalls
from meshlm.gateway.protocol.tool_call_output import Delta, IdMaker, call_id

Schemas = dict[str, dict[str, Any]]  # tool name -> parameter name -> its JSON schema


class XmlCalls(BlockCalls):
    """A block: the call's name (`NAME`), then its parameters (`PARAMETER`: key, value)."""

    NEEDS_TOOLS = True  # built with the request's tools (their parameters' types)

    NAME: re.Pattern[str]
    PARAMETER: re.Pattern[str]
    UNCLOSED: re.Pattern[str]  # a last parameter the block ends in, its closing tag missing

    def __init__(self, tools: list[dict[str, Any]] | None = None,
                 new_id: IdMaker = call_id) -> None:
        super().__init__(new_id)
        self._schemas = parameter_schemas(tools)
        self._begin()

    def _begin(self) -> None:
        self._body, self._at, self._name, self._given = "", 0, "", 0

    def value(self, raw: str) -> str:
        """A parameter's text as the model wrote it, without the format's own spacing."""
        return raw

    def _read(self, text: str, deltas: list[Delta]) -> None:
        self._body += text
        if not self._name:
            named = self.NAME.match(self._body)
            if named is None:
                return
            self._name, self._at = named.group(1).strip(), named.end()
            self._open(self._name, deltas)
        while (found := self.PARAMETER.match(self._body, self._at)) is not None:
            self._parameter(found.group(1), found.group(2), deltas)
            self._at = found.end()

    def _parameter(self, key: str, raw: str, deltas: list[Delta]) -> None:
        key = key.strip()
        schema = self._schemas.get(self._name, {}).get(key)
        value = json.dumps(typed(self.value(raw), schema), ensure_ascii=False)
        self._arguments(f"{', ' if self._given else '{'}{json.dumps(key)}: {value}", deltas)
        self._given += 1

    def _close(self, content: list[str], deltas: list[Delta], closed: bool) -> None:
        """A named call's arguments end (a last parameter without its closing tag is taken);
        a block whose name never came is content, as written."""
        if not self._name:
            named = self.NAME.match(self._body + "\n")  # a bare name, its block closed
            if named is None or not closed:
                content.append(self.OPEN + self._body + (self.CLOSE if closed else ""))
                self._begin()
                return
            self._name, self._at = named.group(1).strip(), named.end()
            self._open(self._name, deltas)
        last = self.UNCLOSED.match(self._body, self._at)
        if last is not None:
            self._parameter(last.group(1), last.group(2), deltas)
        self._arguments("}" if self._given else "{}", deltas)
        self._begin()


class Qwen3CoderCalls(XmlCalls):
    NAME = re.compile(r"\s*<function=([^>\n]+)>")
    PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
    UNCLOSED = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)\s*(?:</function>\s*)?$", re.S)

    def value(self, raw: str) -> str:
        """Without the newline after the opening tag and the one before the closing tag."""
        return raw.removeprefix("\n").removesuffix("\n")


class Glm45Calls(XmlCalls):
    NAME = re.compile(r"\s*([^\n<]+?)[ \t]*(?:\n|(?=<arg_key>))")
    PARAMETER = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
    UNCLOSED = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)\s*$", re.S)


def parameter_schemas(tools: list[dict[str, Any]] | None) -> Schemas:
    """Each function tool's parameters' schemas, by tool and parameter name."""
    out: Schemas = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(properties, dict):
            out[str(function.get("name"))] = properties
    return out


def typed(raw: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: a string stays text; other types are read as
    JSON, else as a Python literal (True, None, single quotes), else kept as text."""
    kind = _type_of(schema)
    if kind == "string":
        return raw
    text = raw.strip()
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return raw
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes, a complex)
        return raw
    return value


def _type_of(schema: Any) -> str | None:
    """The first non-null type a schema names (its "type", or its anyOf / oneOf's)."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    kinds = list(kind) if isinstance(kind, list) else [kind]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            kinds += [o.get("type") for o in options if isinstance(o, dict)]
    for k in kinds:
        if isinstance(k, str) and k != "null":
            return k
    return None
