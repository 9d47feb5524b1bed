"""Heartbeats in a real Redis: an entry per replica whose score is its expiry on Redis's clock,
expired entries pruned, a graceful leave, and a Redis that is away stopping nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from meshlm.common.announce import STALE_AFTER, Announcer, members_key
from meshlm.launch.addresses import free_port
from meshlm.launch.redis_server import RedisServer


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture
def client(server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(server.url, decode_responses=True)
    c.flushall()
    yield c
    c.close()


async def test_a_beat_writes_the_expiry_and_prunes_stale_entries(server, client):
    client.zadd(members_key("scheduler"), {"10.0.0.9:1": 1.0})  # long expired
    announcer = Announcer(server.url, "scheduler", "127.0.0.1:5", interval=0.5)
    await announcer.beat()
    seconds, micros = client.time()
    now = seconds + micros / 1e6
    entries = dict(client.zrange(members_key("scheduler"), 0, -1, withscores=True))
    assert list(entries) == ["127.0.0.1:5"]
    assert now < entries["127.0.0.1:5"] <= now + STALE_AFTER * 0.5
    await announcer.leave()
    assert client.zcard(members_key("scheduler")) == 0


async def test_heartbeats_continue_until_leave(server, client):
    announcer = Announcer(server.url, "tokenizer", "127.0.0.1:6", interval=0.05)
    announcer.start()
    key = members_key("tokenizer")
    first = None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # wait for a second beat: the score moves on
        score = client.zscore(key, "127.0.0.1:6")
        if first is None:
            first = score
        elif score is not None and score > first:
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the heartbeat did not refresh its entry")
    await announcer.leave()
    assert client.zscore(key, "127.0.0.1:6") is None


async def test_no_redis_stops_nothing(caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens
    announcer = Announcer(url, "detokenizer", "127.0.0.1:7", interval=0.05)
    announcer.start()
    deadline = time.monotonic() + 5
    while not announcer.degraded:
        assert time.monotonic() < deadline, "the failure was not noticed"
        await asyncio.sleep(0.01)
    await announcer.leave()  # logs, does not raise
