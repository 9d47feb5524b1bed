"""Which scheduler serves a request: the routing policy (plain Python, no I/O).

1. `routed_dp_rank` given: that replica (the rank is its place in the gateway's scheduler list).
2. Otherwise an affinity key, the request's `routing_key`, else its `session_id`, else the start
   of its prompt, picks a preferred replica by rendezvous hashing (highest hash of key +
   address), so requests that share a key, a session or a prompt prefix land where their prefix
   is cached, and only the keys of a replica that leaves or joins move.
3. The preferred replica is taken while it is not overloaded: its load may exceed the least
   loaded replica's by at most `imbalance` (a share of one replica's running batch). Past that,
   or without a key, the least loaded replica serves.

A replica's load is what the gateway knows now, its own requests in flight there, or what the
scheduler last reported (running + waiting, from every gateway), whichever is larger, over its
batch size, plus its KV cache usage. Reports are polled (`mesh/loads.py`); without them
(a replica that has not answered yet) the gateway's own count stands alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

PREFIX_CHARS = 256  # prompt text that keys affinity when no routing_key is given
PREFIX_IDS = 64     # prompt tokens, likewise


@dataclass(frozen=True)
class Load:
    """A scheduler's last report."""

    running: int = 0
    waiting: int = 0
    max_running: int = 1
    token_usage: float = 0.0  # share of KV cache in use, 0..1


def affinity_key(routing_key: str | None, text: str | None,
                 input_ids: Sequence[int] | None, session_id: str | None = None) -> str:
    """The key that keeps a request with its kin: the client's routing_key, else its
    session_id (SGLang's upstream field: a conversation), else the prompt's first characters
    or tokens (a shared system prompt, a conversation's history)."""
    if routing_key:
        return "k:" + routing_key
    if session_id:
        return "s:" + session_id
    if text is not None:
        return "t:" + text[:PREFIX_CHARS]
    return "i:" + ",".join(map(str, list(input_ids or ())[:PREFIX_IDS]))


def _weight(key: str, address: str) -> int:
    digest = hashlib.blake2b(f"{key}\0{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Router:
    def __init__(self, imbalance: float = 0.5) -> None:
        self.imbalance = imbalance

    def score(self, address: str, inflight: int, loads: Mapping[str, Load]) -> float:
        load = loads.get(address)
        if load is None:
            return float(inflight)
        busy = max(inflight, load.running + load.waiting)
        return busy / max(1, load.max_running) + load.token_usage

    def pick(self, live: Sequence[str], inflight: Callable[[str], int],
             loads: Mapping[str, Load], key: str | None) -> str:
        """One of `live` (non-empty) for a request with affinity `key` (None: no affinity)."""
        if len(live) == 1:
            return live[0]
        scores = {a: self.score(a, inflight(a), loads) for a in live}
        least = min(live, key=lambda a: (scores[a], a))
        if key is None:
            return least
        preferred = max(live, key=lambda a: _weight(key, a))
        if scores[preferred] - scores[least] <= self.imbalance:
            return preferred
        return least
