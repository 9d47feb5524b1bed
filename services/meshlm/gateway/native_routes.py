"""SGLang-native HTTP routes beside /generate (see ../shared/seeds/003_*.txt)."""

from __future__ import annotations

from typing import Any

from starlette.routing import BaseRoute


def native_routes(api: Any) -> list[BaseRoute]:
    """/health_generate, /get_model_info, /get_server_info, /get_load, /abort_request,
    /pause_generation, /continue_generation, /tokenize, /detokenize."""
    return []
