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

from collections.abc import Callable, Sequence

from meshlm.common.metrics import RequestMetrics
from meshlm.common.packed import Plain
from meshlm.gateway.protocol.meta_info import running_meta
from meshlm.gateway.protocol.validation import ValidatedRequest

# Sends one message of the call (its text, ids and meta_info) if it can go at once.
Express = Callable[[str, Sequence[int], dict[str, str]], bool]
DirectWrite = Callable[[Plain], bool]  # a running output, written to the client (True) or not


def direct_write(v: ValidatedRequest, rid: str, clock: RequestMetrics,
                 express: Express | None) -> DirectWrite | None:
    """How the inbox writes request `v`'s running outputs to its client, or None where they
    must go through the handler."""
    if express is None or v.n != 1 or not v.stream or v.embed or v.sampling.return_logprob:
        return None

    def write(item: Plain) -> bool:
        _, ids, prompt, completion, cached, text = item
        if not express(text, ids, running_meta(rid, prompt, completion, cached)):
            return False
        clock.output(prompt, completion, cached)
        return True
    return write
