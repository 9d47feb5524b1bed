"""A chat's chat_template_kwargs (vLLM's and SGLang's name): more variables for the checkpoint's
chat template, such as enable_thinking. The gateway checks them before the chat leaves it; the
tokenizer renders with them and checks again what it is sent."""

from __future__ import annotations

from typing import Any

from meshlm.common.errors import invalid

# What the tokenizer itself gives a chat template; a client's variables may not replace them.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                                "pad_token", "raise_exception", "strftime_now", "tools"})
# The variables a client sets by a field of its own request, not by chat_template_kwargs.
_OWN_FIELDS = ("add_generation_prompt", "tools")
FIELD = "chat_template_kwargs"


def checked_template_kwargs(value: Any) -> dict[str, Any]:
    """`value` (None: none given) as template variables; INVALID_ARGUMENT naming the field when
    it is not a JSON object or names one of the tokenizer's own variables."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(FIELD, "must be an object of template variables, such as "
                             '{"enable_thinking": false}')
    taken = sorted(TEMPLATE_VARIABLES.intersection(value))
    if taken:
        hint = " (use the request's own field)" if taken[0] in _OWN_FIELDS else ""
        raise invalid(f"{FIELD}.{taken[0]}", f"is set by the server, not the client{hint}")
    return value
