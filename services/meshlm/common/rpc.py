"""What a handler knows about the call it serves, whether it came over gRPC or HTTP."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CallContext:
    """Transport-neutral call facts: lower-cased metadata/headers, peer, absolute deadline."""

    metadata: dict[str, str] = field(default_factory=dict)
    peer: str = ""
    deadline: float | None = None  # time.time() seconds, None = no deadline
    transport: str = "grpc"        # "grpc" | "http"
    # What the handler reports beside its reply: gRPC trailing metadata, HTTP response headers.
    trailers: dict[str, str] = field(default_factory=dict)
