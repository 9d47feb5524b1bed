"""The RID registry against a real Redis server, and its fail-open behaviour."""

import pytest
import redis

from meshlm.gateway.mesh import registry
from meshlm.gateway.mesh.registry import RidRegistry, coalesce, command, key
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


def test_commands_are_packed_as_the_client_library_packs_them():
    from redis.asyncio.connection import Connection

    args = ("HSET", "meshlm:rid:é-1", "state", "finished", "n", 3, "empty", "")
    assert command(*args) == b"".join(Connection().pack_command(*args))


async def test_an_error_reply_fails_the_round_and_the_next_one_writes(redis_server):
    """A command Redis refuses raises (the round is kept as unwritten); the connection whose
    replies were not all read is dropped, so the next round's replies are its own."""
    reg = RidRegistry(redis_server.url, ttl=100, finished_ttl=5)
    try:
        with pytest.raises(redis.ResponseError):
            await reg._send([command("EXPIRE", "k", "not-a-number"), command("PING")])
        await reg._send([command("HSET", key("after"), "state", "queued")])
        assert (await reg.get("after")) == {"state": "queued"}
    finally:
        await reg.close()


async def test_a_rounds_writes_go_in_evals_and_a_refused_one_fails_the_round(redis_server,
                                                                         monkeypatch):
    """Many records go as several EVALs of the write script in one round trip, each record
    with its fields and TTL; a record Redis refuses (a key that is not a hash) is the round's
    error, after the script wrote the others."""
    monkeypatch.setattr(registry, "WRITES_PER_EVAL", 3)
    sync = redis.Redis.from_url(redis_server.url, decode_responses=True)
    reg = RidRegistry(redis_server.url, ttl=100, finished_ttl=5)
    try:
        ops = [(f"r{i}", {"state": "running", "n": str(i)}, 5 if i % 2 else None)
               for i in range(7)]
        commands = reg._writes(ops)
        assert len(commands) == 3 and all(c.startswith(b"*") for c in commands)
        await reg._send(commands)
        for i in range(7):
            record = sync.hgetall(key(f"r{i}"))
            assert record["state"] == "running" and record["n"] == str(i)
            assert 0 < sync.ttl(key(f"r{i}")) <= (5 if i % 2 else 100)
        sync.set(key("not-a-hash"), "x")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            await reg._send(reg._writes([("not-a-hash", {"state": "queued"}, None),
                                         ("fine", {"state": "queued"}, None)]))
        assert sync.hget(key("fine"), "state") == "queued"
    finally:
        await reg.close()


def test_coalesce_merges_each_rids_ops_in_order():
    ops = [("a", {"gateway": "g", "state": "queued"}, None),
           ("b", {"state": "running"}, None),
           ("a", {"state": "running"}, None),
           ("b", {"completion_tokens": "3"}, None),
           ("a", {"state": "finished", "finish_reason": "stop"}, 5)]
    assert coalesce(ops) == [
        ("a", {"gateway": "g", "state": "finished", "finish_reason": "stop"}, 5),
        ("b", {"state": "running", "completion_tokens": "3"}, None)]


async def test_a_short_requests_writes_reach_redis_as_one_write(redis_server):
    """create_later, running and finish within one flush interval: one EVAL (by its text:
    EVALSHA would first ask whether the script exists, a round trip of its own) doing one
    HSET with the final state and one EXPIRE with the finished TTL."""
    sync = redis.Redis.from_url(redis_server.url)
    reg = RidRegistry(redis_server.url, ttl=100, finished_ttl=5, flush_interval=0.2)
    reg.start()
    try:
        await reg.get("warm-up")  # the connection and its handshake, before counting
        sync.config_resetstat()
        reg.create_later("short", {"gateway": "g", "scheduler": "s"})
        reg.update("short", state="running")
        reg.finish("short", "finished", finish_reason="length", completion_tokens=1)
        await reg.flush()
        record = await reg.get("short")
        assert record["gateway"] == "g" and record["state"] == "finished"
        assert record["finish_reason"] == "length" and record["completion_tokens"] == "1"
        assert 0 < sync.ttl(key("short")) <= 5
        stats = sync.info("commandstats")
        calls = {c: stats.get(f"cmdstat_{c}", {}).get("calls", 0)
                 for c in ("hset", "expire", "evalsha", "eval", "script", "script|exists")}
        assert calls == {"hset": 1, "expire": 1, "evalsha": 0, "eval": 1, "script": 0,
                         "script|exists": 0}
    finally:
        await reg.close()


async def test_another_gateway_finds_a_record_still_in_its_writers_round(redis_server):
    owner = RidRegistry(redis_server.url, ttl=100, finished_ttl=5)
    other = RidRegistry(redis_server.url, ttl=100, finished_ttl=5)
    owner.start()
    try:
        owner.create_later("fresh", {"gateway": "g", "scheduler": "s"})
        assert await other.get("fresh") is None  # not written yet: the round has not come
        record = await other.find("fresh")
        assert record is not None and record["scheduler"] == "s"
        assert await other.find("never") is None
    finally:
        await owner.close()
        await other.close()


async def test_unreachable_redis_fails_open():
    reg = RidRegistry("redis://127.0.0.1:1/0", ttl=10, finished_ttl=1)
    try:
        assert await reg.create("r", {"gateway": "g"})
        assert reg.degraded
        assert await reg.get("r") is None
    finally:
        await reg.close()


async def _wait(predicate, what: str, timeout: float = 10.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_records_are_written_back_after_redis_restarts_empty():
    """Redis away, then back empty: the live records and the final states of requests that
    ended meanwhile are all written back."""
    with RedisServer() as server:
        reg = RidRegistry(server.url, ttl=100, finished_ttl=50)
        reg.start()
        try:
            assert await reg.create("live", {"gateway": "g", "scheduler": "s"})
            assert await reg.create("ends", {"gateway": "g", "scheduler": "s"})
            reg.update("live", state="running")
            await reg.flush()
            server.kill()
            reg.finish("ends", "finished", finish_reason="length")
            reg.update("live", completion_tokens=7)
            assert await reg.create("new", {"gateway": "g"})  # fail-open while away
            assert reg.degraded
            await reg.flush()
            server.restart()

            async def consistent() -> bool:
                live, ends, new = [await reg.get(r) for r in ("live", "ends", "new")]
                return bool(live and ends and new and ends["state"] == "finished")

            await _wait(consistent, "the records to be written back")
            live = await reg.get("live")
            assert live["state"] == "running" and live["completion_tokens"] == "7"
            assert live["scheduler"] == "s"
            assert (await reg.get("new"))["state"] == "queued"
            assert not reg.degraded
            sync = redis.Redis.from_url(server.url)
            assert 0 < sync.ttl(key("ends")) <= 50
        finally:
            await reg.close()


async def test_a_restart_between_writes_is_noticed_by_its_new_run_id():
    with RedisServer() as server:
        reg = RidRegistry(server.url, ttl=100, finished_ttl=50)
        reg.start()
        try:
            assert await reg.create("kept", {"gateway": "g"})
            await _wait(lambda: _true(reg._run_id is not None), "the first probe")
            server.restart()  # back before any write notices

            async def rewritten() -> bool:
                return await reg.get("kept") is not None

            await _wait(rewritten, "the live record to be rewritten")
        finally:
            await reg.close()


async def _true(value: bool) -> bool:
    return value


async def test_the_writer_outlives_an_unexpected_error(redis_server, monkeypatch):
    """A round that fails with anything (not only Redis's errors) is kept and written later:
    the background writer does not die with it."""
    import meshlm.gateway.mesh.registry as registry

    monkeypatch.setattr(registry, "RETRY_AFTER", 0.05)
    reg = RidRegistry(redis_server.url, ttl=100, finished_ttl=50)
    send = reg._send
    failures = [RuntimeError("a client bug")]

    async def flaky(commands):
        if failures:
            raise failures.pop()
        await send(commands)

    monkeypatch.setattr(reg, "_send", flaky)
    reg.start()
    try:
        reg.create_later("odd", {"gateway": "g"})
        reg.finish("odd", "finished", finish_reason="stop")

        async def written() -> bool:
            record = await reg.get("odd")
            return bool(record and record["state"] == "finished")

        await _wait(written, "the record, after the failed round")
        assert not failures and not reg.degraded
    finally:
        await reg.close()
