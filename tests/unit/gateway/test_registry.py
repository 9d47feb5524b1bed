"""The RID registry against a real Redis server, and its fail-open behaviour."""

import pytest
import redis

from meshlm.gateway.registry import RidRegistry, key
from meshlm.launch.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


async def test_create_is_exclusive_and_finish_sets_short_ttl(redis_server):
    reg = RidRegistry(redis_server.url, ttl=100, finished_ttl=5)
    reg.start()
    try:
        assert await reg.create("r1", {"gateway": "g", "scheduler": "s"})
        assert not await reg.create("r1", {"gateway": "other"})
        record = await reg.get("r1")
        assert record["gateway"] == "g" and record["state"] == "queued"
        sync = redis.Redis.from_url(redis_server.url)
        assert 95 <= sync.ttl(key("r1")) <= 100
        reg.finish("r1", "finished", finish_reason="length")
        await reg.flush()
        assert (await reg.get("r1"))["state"] == "finished"
        assert 0 < sync.ttl(key("r1")) <= 5
    finally:
        await reg.close()


async def test_background_writes_keep_their_order(redis_server):
    reg = RidRegistry(redis_server.url, ttl=100, finished_ttl=5)
    reg.start()
    try:
        reg.create_later("r2", {"gateway": "g"})
        reg.update("r2", state="running")
        reg.finish("r2", "finished", finish_reason="stop")
        await reg.flush()
        record = await reg.get("r2")
        assert record["gateway"] == "g" and record["state"] == "finished"
        assert record["finish_reason"] == "stop"
    finally:
        await reg.close()


async def test_unreachable_redis_fails_open():
    reg = RidRegistry("redis://127.0.0.1:1/0", ttl=10, finished_ttl=1)
    try:
        assert await reg.create("r", {"gateway": "g"})
        assert reg.degraded
        assert await reg.get("r") is None
    finally:
        await reg.close()
