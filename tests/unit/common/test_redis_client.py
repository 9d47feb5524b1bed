"""RedisAuth: the password from a file (not the URL), TLS checked against the mesh CA."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from meshlm.common.redis_client import RedisAuth


@dataclass
class Flags:
    redis_password: str = ""
    redis_password_file: str = ""
    redis_ca: str = ""
    mesh_ca: str = "/certs/ca.pem"


def test_file_wins_and_tls_uses_the_mesh_ca(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("from-file\n")
    auth = RedisAuth.from_config(Flags(redis_password="flag", redis_password_file=str(
        tmp_path / "pw")))
    assert auth == RedisAuth("from-file", "/certs/ca.pem")
    client = auth.connect("rediss://redis:6379/0")
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["password"] == "from-file" and kwargs["ssl_ca_certs"] == "/certs/ca.pem"
    plain = RedisAuth.from_config(Flags()).connect("redis://127.0.0.1:6379/0")
    assert "ssl_ca_certs" not in plain.connection_pool.connection_kwargs


def test_an_unreadable_password_file_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--redis-password-file: cannot read"):
        RedisAuth.from_config(Flags(redis_password_file=str(tmp_path / "missing")))


async def test_a_password_protected_redis_refuses_without_it(tmp_path: Path) -> None:
    from redis.exceptions import AuthenticationError, ResponseError

    from meshlm.launch.redis_server import RedisServer

    server = RedisServer(log_path=tmp_path / "redis.log").start()
    try:
        admin = RedisAuth().connect(server.url)
        await admin.config_set("requirepass", "pw-123")
        with pytest.raises((AuthenticationError, ResponseError)):
            await RedisAuth().connect(server.url).ping()
        assert await RedisAuth("pw-123").connect(server.url).ping()
    finally:
        server.stop()
