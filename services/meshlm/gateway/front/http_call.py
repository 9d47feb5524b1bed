"""What an HTTP request tells a handler: the transport-neutral CallContext of `common/rpc.py`."""

from __future__ import annotations

import time

from starlette.requests import Request

from meshlm.common import deadline
from meshlm.common.rpc import CallContext


def call_context(request: Request) -> CallContext:
    """Lower-cased headers as metadata (repeated headers joined with ","), peer host:port, and
    the deadline a `grpc-timeout` header sets, which also becomes the current one
    (`common/deadline.py`); INVALID_ARGUMENT for a malformed header."""
    metadata: dict[str, str] = {}
    for key, value in request.headers.items():
        metadata[key] = f"{metadata[key]},{value}" if key in metadata else value
    client = request.client
    peer = f"{client.host}:{client.port}" if client else ""
    timeout = metadata.get(deadline.HEADER)
    at = time.time() + deadline.parse_timeout(timeout) if timeout is not None else None
    deadline.set_deadline(at)
    return CallContext(metadata=metadata, peer=peer, deadline=at, transport="http")
