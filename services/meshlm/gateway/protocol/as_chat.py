"""Requests of other APIs served as chat completions (OpenAI's Responses, Anthropic's
Messages): their function tools in the chat's form, and the chat's field paths put back
into the client's words in errors. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from meshlm.common.errors import MeshError, invalid
from meshlm.gateway.protocol.json_body import show
from meshlm.gateway.protocol.openai_errors import field_of


def optional_object(value: Any, path: str) -> dict[str, Any] | None:
    """A field that is an object when given (None: not given)."""
    if value is not None and not isinstance(value, dict):
        raise invalid(path, f"must be an object, got {show(value)}")
    return value


def chat_tools(tools: Any, kind: str, form: str,
               function_of: Callable[[dict[str, Any]], dict[str, Any]],
               paths: dict[str, str]) -> Any:
    """`tools` (each of type `kind`, the default; `form` shows one) as the chat's function
    tools, each's function made by `function_of`; `paths` learns where each came from."""
    if not isinstance(tools, list):
        return tools  # the chat's check says what is wrong
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", kind) != kind:
            raise invalid(f"tools[{i}].type", f"only {form} are supported")
        out.append({"type": "function", "function": function_of(tool)})
        paths[f"tools[{i}].function"] = f"tools[{i}]"
    return out


def client_path(path: str, paths: Mapping[str, str]) -> str:
    """A chat field's path as the client's (by the longest chat path in `paths` leading it)."""
    for chat_path in sorted(paths, key=len, reverse=True):
        if path == chat_path or path.startswith((chat_path + ".", chat_path + "[")):
            return paths[chat_path] + path[len(chat_path):]
    return path


def in_client_words(err: MeshError, paths: Mapping[str, str]) -> MeshError:
    """`err` with its field path (and that path where its message repeats it) the client's."""
    path = field_of(err.message)
    if path is None:
        return err
    new = client_path(path, paths)
    problem = err.message[len(path) + 2:].replace(path, new)
    return MeshError(err.code, f"{new}: {problem}")
