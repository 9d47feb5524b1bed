"""Routes of other APIs served as chat completions (/v1/responses, /v1/messages): the chat's
own implementation (`api/openai.py`) runs the request, and its answer is reshaped
(`protocol/as_chat_output.py`): one JSON body, or the API's SSE events as the chat's chunks
come; a failure after the first event is the API's error event(s)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from meshlm.gateway.api.openai import Chunks
from meshlm.gateway.front.disconnect import unless_disconnected
from meshlm.gateway.front.errors import failure
from meshlm.gateway.front.http_streams import StreamResponse
from meshlm.gateway.front.openai_routes import JSON, first_chunk, last_chunk
from meshlm.gateway.protocol.as_chat_output import ReshapedAnswer
from meshlm.gateway.protocol.openai import ChatRequest
from meshlm.gateway.protocol.openai_logprobs import dumps


async def reshaped(api: Any, chat: ChatRequest, shape_for: Callable[[str], ReshapedAnswer],
                   request: Request) -> Response:
    """The answer to `chat` in another API's shapes (`shape_for` the served model)."""
    chunks = api.openai.chat_chunks(chat)
    if not chat.stream:
        last = await unless_disconnected(last_chunk(chunks), request.receive)
        doc = orjson.loads(last.json_chunk)
        return Response(dumps(shape_for(doc["model"]).whole(doc)), media_type=JSON)
    head = orjson.loads((await first_chunk(chunks, request)).json_chunk)
    return StreamResponse(_events(shape_for(head["model"]), head, chunks, request.url.path),
                          chunks, "text/event-stream")


async def input_tokens(api: Any, chat: ChatRequest, request: Request) -> int:
    """How many tokens `chat`'s messages come to, rendered with its template and tools."""
    tokens = await unless_disconnected(api.tokens.chat_tokens(
        chat.messages, chat.add_generation_prompt, chat.continue_final_message,
        chat.template_kwargs, chat.add_special_tokens, chat.tools), request.receive)
    return len(tokens)


async def _events(shape: ReshapedAnswer, head: dict[str, Any], chunks: Chunks,
                  path: str) -> AsyncIterator[bytes]:
    for event in shape.start() + shape.chunk(head):
        yield shape.sse(event)
    try:
        async for chunk in chunks:
            for event in shape.chunk(orjson.loads(chunk.json_chunk)):
                yield shape.sse(event)
    except Exception as e:  # noqa: BLE001 - the stream's error event says it
        for event in shape.failed(failure(e, path)):
            yield shape.sse(event)
        return
    for event in shape.end():
        yield shape.sse(event)
