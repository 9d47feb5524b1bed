"""The launcher's Redis requires a password it generated: refused without it, and the password
is on no process's command line and in no log file."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from helpers import collect_text, mesh_redis, text_request

from meshlm.launch.mesh import Mesh


def test_the_mesh_redis_refuses_a_client_without_the_password(mesh: Mesh, stub) -> None:
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(mesh.addresses.redis_url, socket_timeout=5).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(mesh.addresses.redis_url, password="guess").ping()
    # The gateway has it: its registry records a request.
    text, msgs = collect_text(stub, text_request("registry check", stream=False,
                                                 rid="redis-auth-1"))
    assert msgs[-1].finished
    assert mesh_redis(mesh).hget("meshlm:rid:redis-auth-1", "gateway")


def test_the_password_is_on_no_command_line_and_in_no_log(mesh: Mesh) -> None:
    assert mesh.redis is not None
    password = mesh.redis.password.encode()
    assert len(password) >= 32
    seen = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            data = cmdline.read_bytes()
        except OSError:
            continue  # exited meanwhile
        seen += 1
        assert password not in data, f"the Redis password is on the command line of {cmdline}"
    assert seen > 5
    logs = list((mesh.workdir / "logs").glob("*.log"))
    assert {p.stem for p in logs} >= {"redis", "gateway", "tokenizer", "scheduler"}
    for log in logs:
        assert password not in log.read_bytes(), f"the Redis password is in {log}"
