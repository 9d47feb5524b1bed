"""What a handler knows about the call it serves, whether it came over gRPC or HTTP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CallContext:
    """Transport-neutral call facts: lower-cased metadata/headers, peer, absolute deadline."""

    metadata: dict[str, str] = field(default_factory=dict)
    peer: str = ""
    deadline: float | None = None  # time.time() seconds, None = no deadline
    transport: str = "grpc"        # "grpc" | "http"
    # What the handler reports beside its reply: gRPC trailing metadata, HTTP response headers.
    trailers: dict[str, str] = field(default_factory=dict)
    # Sends a streamed reply's next message to the client at once, outside the handler's
    # generator, when the transport can take it without waiting (True); None where the
    # transport has no such path. The generation path's direct writes use it (`api/direct.py`).
    write_now: Callable[[Any], bool] | None = None
