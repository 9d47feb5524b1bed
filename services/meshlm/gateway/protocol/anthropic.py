"""Anthropic's Messages API (POST /v1/messages, as vLLM and SGLang serve it), read as the chat
completion it asks for and served as one (`parse_chat`: the same checks, tools, constraints,
reasoning). `system` and `messages` (text, `tool_use` and `tool_result` blocks; earlier
`thinking` blocks as the turn's reasoning) become the chat's messages; `max_tokens`
(required), `stop_sequences`, `temperature`, `top_p`, `top_k`, `tools` (`input_schema`),
`tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`) and `thinking` (the
template's enable_thinking; its budget_tokens a thinking budget where the gateway has a
reasoning parser) their chat counterparts. `anthropic_output.py` shapes the answer.
Pure: no I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from meshlm.common.errors import MeshError, invalid
from meshlm.gateway.protocol.as_chat import (
    chat_tools,
    client_path,
    in_client_words,
    optional_object,
)
from meshlm.gateway.protocol.json_body import is_int, show
from meshlm.gateway.protocol.openai import ChatRequest, parse_chat
from meshlm.gateway.protocol.transcode import parse_json_body
from meshlm.gateway.protocol.validation import unimplemented

# Anthropic's fields read here; the rest are the chat's own (sampling extensions) or refused.
_OWN = ("messages", "system", "max_tokens", "stop_sequences", "tools", "tool_choice",
        "thinking", "metadata", "service_tier")
_CHAT_ONLY = ("max_completion_tokens", "stop", "n", "response_format", "logprobs",
              "tool_choice_auto", "functions", "stream_options")
_UNSERVED = ("container", "mcp_servers", "context_management")


@dataclass
class MessagesRequest:
    chat: ChatRequest
    model: str


def parse_messages(body: bytes) -> MessagesRequest:
    doc = parse_json_body(body)
    if not isinstance(doc, dict):
        raise invalid("body", "must be a JSON object")
    for key in _CHAT_ONLY:
        if doc.get(key) is not None:
            raise invalid(key, "unknown field (a chat completion's; see the Messages API's "
                               "max_tokens, stop_sequences, tool_choice)")
    for key in _UNSERVED:
        if doc.get(key) is not None:
            raise unimplemented(key, "not supported")
    if not isinstance(doc.get("max_tokens"), int) or isinstance(doc.get("max_tokens"), bool):
        raise invalid("max_tokens", f"is required: an integer, got {show(doc.get('max_tokens'))}")
    paths: dict[str, str] = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}
    chat: dict[str, Any] = {k: v for k, v in doc.items() if k not in _OWN}
    chat["messages"] = _messages(doc.get("messages"), doc.get("system"), paths)
    chat["max_completion_tokens"] = doc["max_tokens"]
    if (stops := doc.get("stop_sequences")) is not None:
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise invalid("stop_sequences", f"must be a list of strings, got {show(stops)}")
        chat["stop"] = stops
    if doc.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    if (tools := doc.get("tools")) is not None:
        chat["tools"] = chat_tools(tools, "custom", 'client tools ({"name", "input_schema"})',
                                   _function, paths)
        paths.update({f"tools[{i}].function.parameters": f"tools[{i}].input_schema"
                      for i in range(len(tools) if isinstance(tools, list) else 0)})
    _tool_choice(doc.get("tool_choice"), chat, paths)
    budget = _thinking(doc.get("thinking"), chat)
    try:
        request = parse_chat(orjson.dumps(chat))
    except MeshError as e:
        raise in_client_words(e, paths) from None
    request.names = {k: client_path(v, paths) for k, v in request.names.items()}
    if budget is not None:  # kept where the gateway reads the thinking (a reasoning parser)
        request.thinking_budget, request.budget_if_read = budget, True
        request.names["max_thinking_tokens"] = "thinking.budget_tokens"
    return MessagesRequest(request, str(doc.get("model") or ""))


def _messages(messages: Any, system: Any, paths: dict[str, str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system is not None:
        text = system if isinstance(system, str) else _text(system, "system")
        paths["messages[0]"] = "system"
        out.append({"role": "system", "content": text})
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages")
    for i, message in enumerate(messages):
        path = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise invalid(f"{path}.role", 'must be "user" or "assistant"')
        content = message.get("content")
        if isinstance(content, str):
            paths[f"messages[{len(out)}]"] = path
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{path}.content", "must be a string or a list of content blocks")
        out += _blocks(message["role"], content, f"{path}.content", paths, len(out))
    return out


def _blocks(role: str, blocks: list[Any], path: str, paths: dict[str, str],
            at: int) -> list[dict[str, Any]]:
    """One message's content blocks as chat messages: tool results first (each its own
    tool message), then the text, thinking and tool calls of the turn."""
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{path}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "tool_use" and role == "assistant":
            for key in ("id", "name"):
                if not isinstance(block.get(key), str):
                    raise invalid(f"{where}.{key}", "must be a string")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(f"{where}.tool_use_id", "must be a string")
            content = block.get("content", "")
            text = content if isinstance(content, str) else _text(content, f"{where}.content")
            paths[f"messages[{at + len(results)}]"] = where
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": text})
        else:
            raise invalid(f"{where}.type", "must be text, tool_use or thinking (assistant), or "
                                           f"tool_result (user), got {show(kind)}")
    turn: list[dict[str, Any]] = []
    if texts or calls or thinking or not results:
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        paths[f"messages[{at + len(results)}]"] = path.removesuffix(".content")
        turn.append(message)
    return results + turn


def _text(blocks: Any, path: str) -> str:
    if not isinstance(blocks, list):
        raise invalid(path, "must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
                block.get("text"), str):
            raise invalid(f"{path}[{j}]", 'only text blocks ({"type": "text", "text": ...}) '
                                          "are supported")
        texts.append(block["text"])
    return "".join(texts)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: v for k, v in tool.items() if k in ("name", "description")}
    if "input_schema" in tool:
        function["parameters"] = tool["input_schema"]
    return function


def _tool_choice(given: Any, chat: dict[str, Any], paths: dict[str, str]) -> None:
    if (choice := optional_object(given, "tool_choice")) is None:
        return
    kind = choice.get("type")
    forms = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        paths["tool_choice.function.name"] = "tool_choice.name"
    elif kind in forms:
        chat["tool_choice"] = forms[kind]
    else:
        raise invalid("tool_choice.type", f"must be auto, any, tool or none, got {show(kind)}")
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _thinking(thinking: Any, chat: dict[str, Any]) -> int | None:
    """Extended thinking on or off: the template's enable_thinking; its budget_tokens, if
    given."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise invalid("thinking.type", f'must be "enabled" or "disabled", got {show(kind)}')
    kwargs = dict(chat.get("chat_template_kwargs") or {})
    kwargs.setdefault("enable_thinking", kind != "disabled")
    chat["chat_template_kwargs"] = kwargs
    budget = thinking.get("budget_tokens")
    if budget is None or kind != "enabled":
        return None
    if not is_int(budget) or not 1 <= budget < 2**31:
        raise invalid("thinking.budget_tokens", f"must be a positive integer, got {show(budget)}")
    return int(budget)
