"""OpenAI-compatible HTTP routes."""

from __future__ import annotations

from typing import Any

from starlette.routing import BaseRoute


def openai_routes(api: Any) -> list[BaseRoute]:
    """/v1/chat/completions, /v1/completions, /v1/embeddings."""
    return []
