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
import contextlib
import time
import typing
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
        self._queue: list[tuple[str, str, Any, int | None]] = []
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._busy = False

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name="registry-writer")

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

    def _record(self, fields: dict[str, Any]) -> list[Any]:
        now = time.time()
        argv: list[Any] = [self.ttl]
        for k, v in {**fields, "state": "queued", "created_at": now, "updated_at": now}.items():
            argv += [k, str(v)]
        return argv

    async def create(self, rid: str, fields: dict[str, Any]) -> bool:
        """Record a new request now; False when the rid is already taken (fail-open: True)."""
        if not self._available():
            return True
        try:
            created = await self._create(keys=[key(rid)], args=self._record(fields))
        except (RedisError, OSError) as exc:
            self._failed("create", exc)
            return True
        self._ok()
        return bool(created)

    def create_later(self, rid: str, fields: dict[str, Any]) -> None:
        """Record a request whose rid cannot clash (a fresh uuid4), off the request's path."""
        self._queue.append(("create", rid, self._record(fields), None))
        self._wake.set()

    def update(self, rid: str, **fields: Any) -> None:
        """Set fields in the background (off the request's path)."""
        self._queue.append(("update", rid, fields, None))
        self._wake.set()

    def finish(self, rid: str, state: str, **fields: Any) -> None:
        """Mark the request ended; its record then expires after finished_ttl."""
        self._queue.append(("update", rid, {"state": state, **fields}, self.finished_ttl))
        self._wake.set()

    async def _write_loop(self) -> None:
        """Background writes, in order, many per round trip (one pipeline per wake-up)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            ops, self._queue = self._queue, []
            if not ops or not self._available():
                continue
            self._busy = True
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for op, rid, data, ttl in ops:
                        if op == "create":
                            await self._create(keys=[key(rid)], args=data, client=pipe)
                            continue
                        data = {**data, "updated_at": time.time()}
                        mapping = {k: str(v) for k, v in data.items()}
                        pipe.hset(key(rid), mapping=mapping)
                        pipe.expire(key(rid), ttl if ttl is not None else self.ttl)
                    await pipe.execute()
            except (RedisError, OSError) as exc:
                self._failed("write", exc)
                continue
            finally:
                self._busy = False
            self._ok()

    async def get(self, rid: str) -> dict[str, str] | None:
        if not self._available():
            return None
        try:
            record = typing.cast(dict[str, str], await self._redis.hgetall(key(rid)))
        except (RedisError, OSError) as exc:
            self._failed("get", exc)
            return None
        self._ok()
        return record or None

    async def flush(self) -> None:
        """Wait until the background writes queued so far have been sent (tests, shutdown)."""
        while (self._queue or self._busy) and self._writer is not None and not self._writer.done():
            await asyncio.sleep(0.001)

    async def close(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.flush(), 2.0)
        if self._writer is not None:
            self._writer.cancel()
        await self._redis.aclose()
