"""The OpenAI-shaped SglangService RPCs, mixed into GatewayAPI."""

from __future__ import annotations


class OpenAIRPCs:
    """ChatComplete, Complete, OpenAIEmbed: OpenAI JSON in `json_body`, answered in OpenAI's
    shapes (streamed as OpenAIStreamChunk)."""
