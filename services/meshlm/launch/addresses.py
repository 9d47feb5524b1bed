"""Host:port helpers of the launcher: bind hosts, free ports, addresses to dial."""

from __future__ import annotations

import socket

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")  # bind hosts that mean "every interface"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, close). Callers retry if they lose a race."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


def connectable(address: str) -> str:
    """host:port to dial: no scheme, a wildcard bind host becomes loopback, IPv6 bracketed."""
    host, port = address.split("://", 1)[-1].rstrip("/").rsplit(":", 1)
    host = host.strip("[]")
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
