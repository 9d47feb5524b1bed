"""OpenAI's error shape, and the gateway's field names translated into the client's.

The gateway's validation (and the tokenizer's context check) name fields as the SGLang API has
them ("sampling_params.max_new_tokens: ..."); an OpenAI client wrote "max_tokens". `renamed`
rewrites the field path that starts a MeshError's message; `error_body` is OpenAI's
{"error": {"message", "type", "param", "code"}}, `param` being that field path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import grpc

from meshlm.common.context_length import MAX_NEW_TOKENS
from meshlm.common.errors import MeshError

_FIELD = re.compile(r"[A-Za-z_]\w*(\[\d+\])*(\.\w+(\[\d+\])*)*")
_SAMPLING = "sampling_params."


def field_of(message: str) -> str | None:
    """The field path a message starts with ("top_p: must be ..." -> "top_p"), if any."""
    field, sep, _ = message.partition(": ")
    return field if sep and _FIELD.fullmatch(field) else None


def renamed(err: MeshError, names: Mapping[str, str]) -> MeshError:
    """`err` with its leading field path in the client's words: `names` maps a gateway path
    (without an index, or one leading the field's) to the client's; other sampling_params.*
    lose their prefix."""
    field = field_of(err.message)
    if field is None:
        return err
    problem = err.message[len(field) + 2:]
    leading = [name for name in names if field.startswith(name + ".")]
    if leading:  # a field inside a named one (a structural tag's part)
        name = max(leading, key=len)
        return MeshError(err.code, f"{names[name]}{field[len(name):]}: {problem}")
    base, bracket, index = field.partition("[")
    new = names.get(base)
    if new is None:
        new = base.removeprefix(_SAMPLING)
    elif base == MAX_NEW_TOKENS:
        problem = problem.replace("max_new_tokens", new)
    return MeshError(err.code, f"{new}{bracket}{index}: {problem}")


def model_not_found(model: str, served: str) -> MeshError:
    return MeshError(grpc.StatusCode.NOT_FOUND,
                     f"model: the model `{model}` does not exist; this server serves `{served}`")


_TYPES = {403: "permission_error", 429: "rate_limit_error"}


def error_body(err: MeshError) -> dict[str, Any]:
    """OpenAI's error JSON for a failed request."""
    status = err.http_status
    param = field_of(err.message)
    if err.code == grpc.StatusCode.NOT_FOUND and param == "model":
        code = "model_not_found"
    elif "context length" in err.message:
        code = "context_length_exceeded"
    elif err.code == grpc.StatusCode.UNAUTHENTICATED:  # as OpenAI answers a missing or bad key
        code = "invalid_api_key"
    else:
        code = err.code.name.lower()
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": param, "code": code}}
