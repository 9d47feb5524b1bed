"""RedisServer: a real redis-server on a free loopback port, restartable on the same port."""

from __future__ import annotations

import signal
import socket

import pytest
import redis

from meshlm.launch.redis_server import RedisServer, redis_binary


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_binary_is_found() -> None:
    assert redis_binary().endswith("redis-server")


def test_start_ping_set_get_stop() -> None:
    server = RedisServer().start()
    try:
        assert server.running and server.port > 0
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.set("greeting", "hello")
        assert client.get("greeting") == b"hello"
        client.close()
    finally:
        server.stop()
    assert not server.running
    assert _refused(server.port)
    server.stop()  # idempotent


def test_restart_keeps_the_port_and_nothing_else() -> None:
    with RedisServer() as server:
        port = server.port
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        server.restart()
        assert server.port == port
        assert client.ping()  # redis-py reconnects on the same URL
        assert client.get("k") is None  # --save "" --appendonly no: nothing persisted
        client.close()


def test_kill_then_restart() -> None:
    with RedisServer() as server:
        server.kill(signal.SIGKILL)
        assert not server.running
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()
        server.restart()
        assert redis.Redis.from_url(server.url).ping()


def test_two_servers_side_by_side() -> None:
    with RedisServer() as a, RedisServer() as b:
        assert a.port != b.port
        redis.Redis.from_url(a.url).set("who", "a")
        assert redis.Redis.from_url(b.url).get("who") is None
