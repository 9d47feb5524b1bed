"""Heartbeats in Redis: a tokenizer, scheduler or detokenizer says "I am here" so that gateways
started with --discover find it (and see it go) without a restart or a static list.

Each role has one sorted set, `meshlm:members:<role>`: member = the replica's advertised mesh
address, score = when its entry expires (unix seconds, Redis's clock, so the replicas' and the
gateways' clocks need not agree). A replica refreshes its entry every `interval` seconds with an
expiry `STALE_AFTER` intervals ahead, so a replica that died without a word (kill -9, a lost
node) drops out within that time; one that stops on SIGTERM removes its entry first (graceful
leave). Every heartbeat also prunes expired entries of its role, so the set does not grow.

Redis is never a reason to stop serving: while it is away the announcer logs
`announce_degraded` once and keeps trying every interval.
"""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from meshlm.common.logs import get_logger
from meshlm.common.redis_client import NO_AUTH, RedisAuth

log = get_logger(__name__)

KEY_PREFIX = "meshlm:members:"
STALE_AFTER = 3  # heartbeat intervals without a refresh after which an entry is stale


def members_key(role: str) -> str:
    """The sorted set of a role's announced replicas."""
    return KEY_PREFIX + role


def expiry(now: float, interval: float) -> float:
    """The score a heartbeat sent at `now` writes: stale after STALE_AFTER missed beats."""
    return now + STALE_AFTER * interval


async def redis_now(client: aioredis.Redis) -> float:
    """Redis's clock in unix seconds (one clock for every replica and gateway)."""
    seconds, micros = await client.time()
    return seconds + micros / 1e6


class Announcer:
    """Keeps `address` in `meshlm:members:<role>` while this service is SERVING."""

    def __init__(self, url: str, role: str, address: str, interval: float,
                 auth: RedisAuth = NO_AUTH) -> None:
        timeout = max(0.2, min(1.0, interval))
        self._redis = auth.connect(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.url, self.role, self.address, self.interval = url, role, address, interval
        self.key = members_key(role)
        self.degraded = False
        self._announced = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"announce:{self.role}")

    async def beat(self) -> None:
        """Refresh this replica's entry and prune the role's expired ones (one round trip
        for the clock, one pipeline for both writes)."""
        now = await redis_now(self._redis)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.key, {self.address: expiry(now, self.interval)})
            pipe.zremrangebyscore(self.key, "-inf", now)
            await pipe.execute()

    async def _run(self) -> None:
        while True:
            try:
                await self.beat()
            except (RedisError, OSError) as exc:
                if not self.degraded:
                    log.warning("announce_degraded", role=self.role, address=self.address,
                                error=repr(exc))
                self.degraded = True
            else:
                if self.degraded or not self._announced:
                    log.info("announced", role=self.role, address=self.address, key=self.key,
                             interval=self.interval)
                self.degraded, self._announced = False, True
            await asyncio.sleep(self.interval)  # the heartbeat period, not synchronisation

    async def leave(self) -> None:
        """Stop the heartbeats and remove this replica's entry, so gateways drop it now
        rather than after expiry. A Redis that does not answer only delays that."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self._redis.zrem(self.key, self.address)
            log.info("announce_left", role=self.role, address=self.address)
        except (RedisError, OSError) as exc:
            log.warning("announce_leave_failed", role=self.role, address=self.address,
                        error=repr(exc))
        await self._redis.aclose()
