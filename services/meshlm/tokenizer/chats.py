"""OpenAI chats, rendered by the checkpoint's chat template: for ApplyChatTemplate, and for a
chat that comes in the Submit stream as its prompt (rendered and encoded in the same step as
any prompt, without a round trip of its own before it). Pure; runs on the worker threads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from meshlm.common.chat_variables import FIELD, checked_template_kwargs
from meshlm.common.errors import MeshError, invalid
from meshlm.tokenizer.tokenization import ChatTemplateError, TextTokenizer
from meshlm.v1 import tokenizer_pb2


@dataclass(frozen=True)
class Refused:
    """A chat whose messages the template could not render: the request's INVALID_ARGUMENT."""

    message: str


def render_chat(tok: TextTokenizer, chat: tokenizer_pb2.ChatTemplateRequest) -> str:
    """The chat's prompt text; MeshError(INVALID_ARGUMENT, "messages: ...") when its messages
    are not a JSON list or the template refuses them. Encode it without special tokens: the
    templates write their own (bos)."""
    try:
        messages = json.loads(chat.messages_json)
    except ValueError as e:
        raise invalid("messages", f"not valid JSON: {e}") from None
    if not isinstance(messages, list):
        raise invalid("messages", "must be a list of messages")
    kwargs = template_kwargs(chat.template_kwargs_json)
    if chat.tools_json:
        try:
            kwargs = {**kwargs, "tools": json.loads(chat.tools_json)}
        except ValueError as e:
            raise invalid("tools", f"not valid JSON: {e}") from None
    try:
        return tok.apply_chat_template(messages, chat.add_generation_prompt,
                                       chat.continue_final_message, kwargs, chat.chat_template)
    except ChatTemplateError as e:
        raise invalid("chat_template", str(e)) from None
    except ValueError as e:
        raise invalid("messages", str(e)) from None


def template_kwargs(text: str) -> dict[str, Any]:
    """A chat's template variables from their JSON (empty: none), checked again here."""
    if not text:
        return {}
    try:
        return checked_template_kwargs(json.loads(text))
    except ValueError as e:
        raise invalid(FIELD, f"not valid JSON: {e}") from None


def rendered_or_refused(tok: TextTokenizer, chat: tokenizer_pb2.ChatTemplateRequest
                        ) -> str | Refused:
    """`render_chat`, its refusal as a value (one chat's refusal ends its request only)."""
    try:
        return render_chat(tok, chat)
    except MeshError as e:
        return Refused(e.message)
