"""A streamed response's head and first chunk are corked together on uvicorn's TCP socket
(`http_streams._cork`), and nothing is touched where there is no such socket."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from meshlm.gateway.front.http_streams import _cork, _uncork


class Transport:
    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None


class Cycle:
    """What uvicorn's `send` is bound to: its connection's transport."""

    def __init__(self, sock: socket.socket | None) -> None:
        self.transport = Transport(sock)

    async def send(self, message: Any) -> None:
        pass


@pytest.mark.skipif(not hasattr(socket, "TCP_CORK"), reason="Linux's TCP_CORK")
def test_a_tcp_socket_is_corked_and_uncorked() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    try:
        corked = _cork(Cycle(client).send)
        assert corked is client
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 1
        _uncork(corked)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 0
    finally:
        client.close()
        listener.close()


def test_nothing_is_corked_without_a_tcp_socket() -> None:
    left, right = socket.socketpair()  # a Unix socket
    try:
        assert _cork(Cycle(left).send) is None
        assert _cork(Cycle(None).send) is None
        assert _cork(lambda message: None) is None  # another server's send
        assert _cork(Cycle(None).send.__self__.transport.get_extra_info) is None
        odd = Cycle(None)
        odd.transport = object()  # type: ignore[assignment]  # not an asyncio transport
        assert _cork(odd.send) is None
    finally:
        left.close()
        right.close()
