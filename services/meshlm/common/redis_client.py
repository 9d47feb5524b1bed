"""One way to open Redis for every service: URL, password (flag or file) and TLS.

The password never sits in the URL that is logged: it comes from `--redis-password` or
`--redis-password-file` (a mounted secret). A `rediss://` URL is TLS; the server's certificate
must chain to `--redis-ca`, else the mesh CA.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import redis.asyncio as aioredis


class _RedisFlags(Protocol):
    redis_password: str
    redis_password_file: str
    redis_ca: str
    mesh_ca: str


@dataclass(frozen=True)
class RedisAuth:
    """How to authenticate to, and verify, the mesh's Redis."""

    password: str = ""
    ca: str = ""

    @classmethod
    def from_config(cls, config: _RedisFlags) -> RedisAuth:
        """From a ServiceConfig; ValueError naming the flag when the password file is unreadable."""
        password = config.redis_password
        if config.redis_password_file:
            try:
                password = Path(config.redis_password_file).read_text().strip()
            except OSError as e:
                raise ValueError(f"--redis-password-file: cannot read "
                                 f"{config.redis_password_file!r}: {e.strerror or e}") from e
        return cls(password, config.redis_ca or config.mesh_ca)

    def connect(self, url: str, **kwargs: Any) -> aioredis.Redis:
        """An asyncio client for `url` (decode_responses on), with these credentials."""
        if self.password:
            kwargs["password"] = self.password
        if url.startswith("rediss://") and self.ca:
            kwargs["ssl_ca_certs"] = self.ca
        return aioredis.Redis.from_url(url, decode_responses=True, **kwargs)


NO_AUTH = RedisAuth()  # a local Redis without password or TLS (tests, the default)
