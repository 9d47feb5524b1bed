"""/tokenize and /detokenize (SGLang's native routes) and /v1/tokenize, /v1/detokenize (the
OpenAI-serving names, answering errors in OpenAI's shape): one pair of handlers, mounted under
both prefixes. Bodies as SGLang's and vLLM's:

- tokenize: {"prompt": str | [str, ...], "add_special_tokens": true} or {"messages": [...],
  "add_generation_prompt": true, "continue_final_message": false, "chat_template_kwargs": {},
  "tools": [...]} (a chat, rendered by the checkpoint's template with those variables and
  tools; continuing leaves the final message open; add_special_tokens, false for a chat, adds
  the tokenizer's on top) -> {"tokens", "count", "max_model_len"} (lists for a list of
  prompts). The empty prompt is valid: its tokens are the special ones it gets, if any.
- detokenize: {"tokens": [id, ...] | [[id, ...], ...], "skip_special_tokens": true} ->
  {"text": str | [str, ...]}; no tokens give "".
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.routing import BaseRoute, Route

from meshlm.common.chat_variables import FIELD as TEMPLATE_KWARGS
from meshlm.common.chat_variables import checked_template_kwargs
from meshlm.common.errors import MeshError, invalid
from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.front.json_fields import body_of, bool_field, json_endpoint, string_field
from meshlm.gateway.protocol.openai import chat_rendering
from meshlm.gateway.protocol.tool_calls import checked_tools
from sglang.runtime.v1 import sglang_pb2 as pb

MAX_PROMPTS = 1024  # prompts (or token lists) in one call
_INT32 = 2**31


def token_routes(api: Any, prefix: str) -> list[BaseRoute]:
    """The two routes over `api` (a GatewayAPI) under `prefix` ("" or "/v1")."""
    h = _TokenHandlers(api)
    return [Route(f"{prefix}/tokenize", json_endpoint(h.tokenize), methods=["POST"]),
            Route(f"{prefix}/detokenize", json_endpoint(h.detokenize), methods=["POST"])]


class _TokenHandlers:
    def __init__(self, api: Any) -> None:
        self.api = api

    async def tokenize(self, request: Request) -> dict[str, Any]:
        doc = await body_of(request, ("prompt", "messages", "add_special_tokens",
                                      "add_generation_prompt", "continue_final_message",
                                      TEMPLATE_KWARGS, "tools", "chat_template", "model"))
        string_field(doc, "model", "")  # one model is served: the name is not checked
        if "messages" in doc:
            return await self._chat(doc)
        for key in ("add_generation_prompt", "continue_final_message", TEMPLATE_KWARGS, "tools",
                    "chat_template"):
            if key in doc:
                raise invalid(key, "is for a chat's messages")
        add_special = bool_field(doc, "add_special_tokens", True)
        if "prompt" not in doc:
            raise invalid("prompt", "give a string or a list of them (or a chat's messages)")
        prompt = doc["prompt"]
        batch = isinstance(prompt, list)
        prompts = _batch(prompt if isinstance(prompt, list) else [prompt], "prompt")
        for i, text in enumerate(prompts):
            if not isinstance(text, str):
                raise invalid(f"prompt[{i}]" if batch else "prompt",
                              "give a string" + ("" if batch else " or a list of them"))
        ctx = call_context(request)
        replies = await asyncio.gather(*(self.api.tokens.Tokenize(
            pb.TokenizeRequest(text=text, add_special_tokens=add_special), ctx)
            for text in prompts))
        tokens = [list(r.tokens) for r in replies]
        counts = [r.count for r in replies]
        return {"tokens": tokens if batch else tokens[0],
                "count": counts if batch else counts[0],
                "max_model_len": replies[0].max_model_len}

    async def _chat(self, doc: dict[str, Any]) -> dict[str, Any]:
        if "prompt" in doc:
            raise invalid("messages", "give prompt or messages, not both")
        messages = doc["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) for m in messages):
            raise invalid("messages", "give a non-empty list of message objects")
        add_prompt, keep_open = chat_rendering(
            bool_field(doc, "add_generation_prompt", True) if "add_generation_prompt" in doc
            else None, bool_field(doc, "continue_final_message", False))
        kwargs = checked_template_kwargs(doc.get(TEMPLATE_KWARGS))
        special = bool_field(doc, "add_special_tokens", False)  # the template writes its own
        tools = checked_tools(doc.get("tools"))
        tokens = await self.api.tokens.chat_tokens(messages, add_prompt, keep_open, kwargs,
                                                   special, tools,
                                                   string_field(doc, "chat_template", ""))
        model = await self.api.core.model_info()
        return {"tokens": tokens, "count": len(tokens), "max_model_len": model.max_model_len}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        doc = await body_of(request, ("tokens", "skip_special_tokens", "model"))
        string_field(doc, "model", "")
        skip = bool_field(doc, "skip_special_tokens", True)
        tokens = doc.get("tokens")
        if not isinstance(tokens, list):
            raise invalid("tokens", "give a list of token ids, or a list of such lists")
        batch = bool(tokens) and all(isinstance(t, list) for t in tokens)
        lists = _batch(tokens if batch else [tokens], "tokens")
        for i, ids in enumerate(lists):
            _check_ids(ids, f"tokens[{i}]" if batch else "tokens")
        ctx = call_context(request)

        async def one(i: int, ids: list[int]) -> str:
            try:
                reply = await self.api.tokens.Detokenize(pb.DetokenizeRequest(tokens=ids), ctx,
                                                         skip_special_tokens=skip)
            except MeshError as e:  # its message names "tokens[j]": say which list
                if batch and e.message.startswith("tokens["):
                    e = MeshError(e.code, f"tokens[{i}]" + e.message[len("tokens"):])
                raise e from None
            return str(reply.text)

        texts = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(lists)))
        return {"text": texts if batch else texts[0]}


def _batch(items: list[Any], key: str) -> list[Any]:
    if not items:
        raise invalid(key, "must not be an empty list")
    if len(items) > MAX_PROMPTS:
        raise invalid(key, f"has {len(items)} entries; at most {MAX_PROMPTS} per request")
    return items


def _check_ids(ids: Any, where: str) -> None:
    """A list of token ids that fit the wire (the API checks them against the vocabulary)."""
    if not isinstance(ids, list):
        raise invalid(where, "give a list of token ids")
    for j, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise invalid(f"{where}[{j}]", f"must be an integer token id, got {json.dumps(t)}")
        if t < 0:
            raise invalid(f"{where}[{j}]", f"token id {t} is out of range: token ids are "
                                           "non-negative")
        if t >= _INT32:
            raise invalid(f"{where}[{j}]", f"token id {t} is out of range")
