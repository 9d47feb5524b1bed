"""The shared RID registry in Redis: who owns a request, where it runs, its state.

One hash per request, `meshlm:rid:<rid>`, with fields gateway, tokenizer, scheduler,
detokenizer, state (queued | running | finished | aborted | error), finish_reason,
created_at, updated_at (unix seconds). A live record expires after `ttl` (a gateway that died
leaves no record behind for ever); a finished one after `finished_ttl`.

The registry fails open: when Redis is unreachable, generation goes on without it (duplicate
detection across gateways is then skipped), `degraded` is set and logged once, and Redis is
tried again after a short pause.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from meshlm.common.logs import get_logger

log = get_logger(__name__)

KEY_PREFIX = "meshlm:rid:"
RETRY_AFTER = 2.0  # seconds without Redis after a failure

# Create only if absent; set fields and TTL atomically. ARGV = ttl, field, value, ...
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


def key(rid: str) -> str:
    return KEY_PREFIX + rid


class RidRegistry:
    def __init__(self, url: str, ttl: float, finished_ttl: float) -> None:
        self._redis = aioredis.Redis.from_url(url, socket_timeout=1.0,
                                              socket_connect_timeout=1.0, decode_responses=True)
        self._create = self._redis.register_script(_CREATE)
        self.ttl = max(1, int(ttl))
        self.finished_ttl = max(1, int(finished_ttl))
        self.degraded = False
        self._retry_at = 0.0
        self._tasks: set[asyncio.Task[None]] = set()

    def _available(self) -> bool:
        return not self.degraded or time.monotonic() >= self._retry_at

    def _failed(self, op: str, exc: Exception) -> None:
        if not self.degraded:
            log.warning("registry_degraded", op=op, error=repr(exc))
        self.degraded = True
        self._retry_at = time.monotonic() + RETRY_AFTER

    def _ok(self) -> None:
        if self.degraded:
            log.info("registry_recovered")
        self.degraded = False

    async def create(self, rid: str, fields: dict[str, Any]) -> bool:
        """Record a new request; False when the rid is already taken (fail-open: True)."""
        if not self._available():
            return True
        now = time.time()
        record = {**fields, "state": "queued", "created_at": now, "updated_at": now}
        argv: list[Any] = [self.ttl]
        for k, v in record.items():
            argv += [k, str(v)]
        try:
            created = await self._create(keys=[key(rid)], args=argv)
        except (RedisError, OSError) as exc:
            self._failed("create", exc)
            return True
        self._ok()
        return bool(created)

    def update(self, rid: str, **fields: Any) -> None:
        """Set fields in the background (off the request's path)."""
        self._spawn(self._update(rid, fields, None))

    def finish(self, rid: str, state: str, **fields: Any) -> None:
        """Mark the request ended; its record then expires after finished_ttl."""
        self._spawn(self._update(rid, {"state": state, **fields}, self.finished_ttl))

    async def _update(self, rid: str, fields: dict[str, Any], ttl: int | None) -> None:
        if not self._available():
            return
        mapping = {k: str(v) for k, v in {**fields, "updated_at": time.time()}.items()}
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(key(rid), mapping=mapping)
                pipe.expire(key(rid), ttl if ttl is not None else self.ttl)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("update", exc)
            return
        self._ok()

    async def get(self, rid: str) -> dict[str, str] | None:
        if not self._available():
            return None
        try:
            record = await self._redis.hgetall(key(rid))
        except (RedisError, OSError) as exc:
            self._failed("get", exc)
            return None
        self._ok()
        return record or None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        await self._redis.aclose()
