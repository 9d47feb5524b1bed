"""Direct writes: a streamed request's plain outputs go from the inbox straight to its client.

Between engine steps a streaming call's handler waits on its request's mailbox. Waking it for
every token costs a task switch and a pass through its generators (the api's layers, the
servicer's, the interceptors'), about as much CPU as the rest of the gateway's work on that
token. So while the handler waits, and the call's transport can take a message at once (the
native gRPC server: `CallContext.write_now`), the inbox builds the running output's message and
sends it itself: the same message, meta_info and metrics the handler would have made.

Only the plain middle of a stream goes this way: one sample (n == 1), streamed, without
logprobs, not an embedding, after its first output. The first and last outputs, errors, and a
message the stream cannot take at once (a slow client, a full window) go through the mailbox
and the handler as before; the handler is then awake, and nothing is written directly until it
waits again, so the client's messages stay in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from meshlm.common.logs import get_logger
from meshlm.common.metrics import RequestMetrics
from meshlm.common.packed import Plain
from meshlm.gateway.protocol.validation import ValidatedRequest

log = get_logger(__name__)

# Sends a running output as the call's next message (built by the front: its proto's bytes,
# its SSE event), if it can go at once; False, with nothing sent or kept, otherwise.
Express = Callable[[Plain], bool]


class ChunkWriter(Protocol):
    """Where an OpenAI stream's chunks (their JSON) can be written directly: the HTTP front's
    SSE connection (`front/http_streams.DirectBody`)."""

    def writable(self) -> bool: ...

    def write(self, chunk: bytes) -> None: ...


def direct_write(v: ValidatedRequest, clock: RequestMetrics,
                 express: Express | None) -> Express | None:
    """How the inbox writes request `v`'s running outputs to its client, or None where they
    must go through the handler. (The message's meta_info is `protocol/meta_info.py`'s
    `running_meta`: the rid and three counts.)"""
    if express is None or v.n != 1 or not v.stream or v.embed or v.sampling.return_logprob:
        return None

    broken = False

    def write(item: Plain) -> bool:
        nonlocal broken
        if broken:
            return False
        try:
            if not express(item):
                return False
        except Exception:  # noqa: BLE001 - a bug here must not end the inbox's stream
            log.exception("direct_write_failed", rid=item[0])
            broken = True  # this request's outputs go through its handler from now on
            return False
        clock.output(item[2], item[3], item[4])
        return True
    return write
