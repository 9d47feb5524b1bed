"""OpenAI's Responses API (POST /v1/responses), served statelessly: a request is read as the
chat completion it asks for, and served as one (`parse_chat`: the same checks, tools,
constraints, reasoning). Its own fields become the chat's: `input` (text, or items:
messages, earlier `function_call`s and their `function_call_output`s) and `instructions`
the messages, `max_output_tokens`, the flat function `tools` and `tool_choice`,
`text.format` (response_format), `reasoning.effort`, `top_logprobs`; the chat's other
fields (sampling extensions such as top_k or seed) pass as they are. Nothing is stored:
`previous_response_id`, `conversation` and `background` are refused, so the conversation
travels in `input`, as vLLM without its store. Errors name the fields as the client wrote
them. `responses_output.py` shapes the answer. Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from meshlm.common.errors import MeshError, invalid
from meshlm.gateway.protocol.as_chat import (
    chat_tools,
    client_path,
    in_client_words,
    optional_object,
)
from meshlm.gateway.protocol.json_body import show
from meshlm.gateway.protocol.openai import ChatRequest, parse_chat
from meshlm.gateway.protocol.transcode import parse_json_body
from meshlm.gateway.protocol.validation import unimplemented

# Chat fields a Responses request says otherwise (`input`, `max_output_tokens`, `text`...).
_CHAT_ONLY = ("messages", "max_tokens", "max_completion_tokens", "response_format", "logprobs",
              "n", "functions", "function_call", "echo", "stop")
_STATEFUL = {"previous_response_id": "responses are not stored here; send the conversation "
                                     "so far as input",
             "conversation": "conversations are not stored here; send them as input",
             "prompt": "stored prompt templates are not supported; send the prompt as input"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_INCLUDE = ("message.output_text.logprobs", "reasoning.encrypted_content")
_ROLES = ("user", "system", "developer", "assistant")


@dataclass
class ResponsesRequest:
    """A Responses request as the chat it asks for, with what its answer repeats."""

    chat: ChatRequest
    echo: dict[str, Any] = field(default_factory=dict)  # the Response object's request fields


def parse_responses(body: bytes) -> ResponsesRequest:
    doc = parse_json_body(body)
    if not isinstance(doc, dict):
        raise invalid("body", "must be a JSON object")
    paths: dict[str, str] = {}  # the chat's field paths -> the client's
    chat = _chat_doc(dict(doc), paths)
    try:
        request = parse_chat(orjson.dumps(chat))
    except MeshError as e:
        raise in_client_words(e, paths) from None
    # Errors found later (the gateway's checks, the scheduler's) name the client's fields too.
    request.names = {k: client_path(v, paths) for k, v in request.names.items()}
    request.names.setdefault("messages", "input")
    return ResponsesRequest(request, _echo(doc))


def _chat_doc(doc: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    for key in _CHAT_ONLY:
        if doc.get(key) is not None:
            raise invalid(key, "unknown field (a chat completion's; see the Responses API's "
                               "input, max_output_tokens, text.format, top_logprobs)")
    for key, why in _STATEFUL.items():
        if doc.pop(key, None) is not None:
            raise unimplemented(key, why)
    if doc.pop("background", None):
        raise unimplemented("background", "responses run in the foreground only")
    truncation = doc.pop("truncation", None)
    if truncation not in (None, "disabled"):
        raise unimplemented("truncation", f'only "disabled" is supported, got '
                                                    f'{show(truncation)}')
    if doc.pop("max_tool_calls", None) is not None:
        raise unimplemented("max_tool_calls", "not supported")
    options = doc.pop("stream_options", None)  # include_obfuscation: nothing is padded here
    if options is not None and (not isinstance(options, dict)
                                or set(options) - {"include_obfuscation"}):
        raise invalid("stream_options", "may hold include_obfuscation only, got "
                                        f"{show(options)}")
    include = doc.pop("include", None) or []
    if not isinstance(include, list) or any(i not in _INCLUDE for i in include):
        raise invalid("include", f"may list {', '.join(_INCLUDE)}, got {show(include)}")
    chat: dict[str, Any] = {k: v for k, v in doc.items()
                            if k not in ("input", "instructions", "max_output_tokens", "text",
                                         "reasoning", "tools", "tool_choice", "top_logprobs")}
    chat["messages"] = _messages(doc.get("input"), doc.get("instructions"), paths)
    paths["messages"] = "input"
    if (limit := doc.get("max_output_tokens")) is not None:
        chat["max_completion_tokens"] = limit
    paths["max_completion_tokens"] = paths["max_tokens"] = "max_output_tokens"
    if (top := doc.get("top_logprobs")) is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top
    if "message.output_text.logprobs" in include:
        chat["logprobs"] = True
    if doc.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    _text_format(doc.get("text"), chat, paths)
    _reasoning(doc.get("reasoning"), chat, paths)
    if (tools := doc.get("tools")) is not None:
        chat["tools"] = chat_tools(tools, "function", 'function tools ({"type": "function", '
                                   '"name": ...})', _function, paths)
    if (choice := doc.get("tool_choice")) is not None:
        chat["tool_choice"] = _tool_choice(choice, paths)
    return chat


def _messages(items: Any, instructions: Any, paths: dict[str, str]) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages; `paths` maps each to its input item."""
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", f"must be a string, got {show(instructions)}")
    messages: list[dict[str, Any]] = []
    if instructions:
        paths[f"messages[{len(messages)}]"] = "instructions"
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif not isinstance(items, list) or not items:
        raise invalid("input", "must be a string or a non-empty list of input items")
    for i, item in enumerate(items):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(path, "must be an input item (a message, function_call or "
                                "function_call_output)")
        kind = item.get("type", "message")
        if kind == "message":
            paths[f"messages[{len(messages)}]"] = path
            messages.append(_message(item, path))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise invalid(f"{path}.{key}", "must be a string")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # one turn's calls, together
            else:
                paths[f"messages[{len(messages)}]"] = path
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"{path}.call_id", "must be a string")
            paths[f"messages[{len(messages)}]"] = path
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text(
                                 output, f"{path}.output")})
        elif kind != "reasoning":  # an earlier answer's reasoning: templates drop it
            raise invalid(f"{path}.type", "must be message, function_call, "
                                          f"function_call_output or reasoning, got {show(kind)}")
    return messages


def _message(item: dict[str, Any], path: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid(f"{path}.role", f"must be one of {', '.join(_ROLES)}; got {show(role)}")
    content = item.get("content")
    text = content if isinstance(content, str) else _text(content, f"{path}.content")
    return {"role": role, "content": text}


def _text(parts: Any, path: str) -> str:
    """Content parts as text: only text parts are served."""
    if not isinstance(parts, list):
        raise invalid(path, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise invalid(f"{path}[{j}]", "only text parts ({\"type\": \"input_text\"}) are "
                                          "supported")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{path}[{j}].text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _text_format(given: Any, chat: dict[str, Any], paths: dict[str, str]) -> None:
    """`text.format` as the chat's response_format (text: none)."""
    if (text := optional_object(given, "text")) is None:
        return
    form = text.get("format")
    if form is None or (isinstance(form, dict) and form.get("type") == "text"):
        return
    if not isinstance(form, dict):
        raise invalid("text.format", f"must be an object, got {show(form)}")
    if form.get("type") == "json_schema":
        inner = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        chat["response_format"] = {"type": "json_schema", "json_schema": inner}
        paths["response_format.json_schema"] = "text.format"
    else:
        chat["response_format"] = form
    paths["response_format"] = "text.format"


def _reasoning(given: Any, chat: dict[str, Any], paths: dict[str, str]) -> None:
    if (reasoning := optional_object(given, "reasoning")) is None:
        return
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
        paths["reasoning_effort"] = "reasoning.effort"


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in tool.items() if k != "type"}


def _tool_choice(choice: Any, paths: dict[str, str]) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        paths["tool_choice.function.name"] = "tool_choice.name"
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _echo(doc: dict[str, Any]) -> dict[str, Any]:
    """The request's fields that a Response object repeats, as given (OpenAI's defaults)."""
    text = doc.get("text") if isinstance(doc.get("text"), dict) else {}
    reasoning = doc.get("reasoning") if isinstance(doc.get("reasoning"), dict) else {}
    assert text is not None and reasoning is not None
    return {
        "background": False,
        "instructions": doc.get("instructions"),
        "max_output_tokens": doc.get("max_output_tokens"),
        "metadata": doc.get("metadata") or {},
        "parallel_tool_calls": doc.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": reasoning.get("effort"), "summary": None},
        "store": False,
        "temperature": doc.get("temperature", 1.0),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": doc.get("tool_choice", "auto"),
        "tools": doc.get("tools") or [],
        "top_logprobs": doc.get("top_logprobs", 0),
        "top_p": doc.get("top_p", 1.0),
        "truncation": "disabled",
        "user": doc.get("user"),
    }
