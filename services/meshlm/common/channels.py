"""Client channels between mesh services: mutual TLS, keepalive, fast reconnect, one per address.

How fast a hung peer is noticed. A replica that stops answering (SIGSTOP, a frozen VM, a lost
host or link) is treated as down within DOWN_BOUND seconds: the caller's side of every mesh
connection pings once it has read nothing for KEEPALIVE_TIME_MS and closes the connection when
the answer takes longer than PING_TIMEOUT_MS, which fails every call on it (UNAVAILABLE): the
gateway's health Watch (its requests there end, routing leaves the replica) and the batched
streams to it (what they held is dropped). gRPC bounds every ping by
`grpc.http2.ping_timeout_ms` (default 60 s) as well as the keepalive timeout, and a keepalive
ping that finds another ping in flight waits for that one, so both are set. The servers'
side (`common/server.py`) pings silent clients too, and lets the clients ping this often.
A scheduler whose engine stops making progress is the scheduler's own watchdog's to report
(`scheduler/watchdog.py`), within the same bound.
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from meshlm.common.native_grpc.client import NativeChannel

DOWN_BOUND = 5.0  # seconds from a replica hanging to its requests ending UNAVAILABLE
KEEPALIVE_TIME_MS = 1_000  # a mesh client pings a connection silent this long
PING_TIMEOUT_MS = 2_000  # and closes it when the ping's answer takes longer
SERVER_KEEPALIVE_TIME_MS = 2_000  # a server pings a silent client (slower: public clients too)
SERVER_PING_TIMEOUT_MS = 3_000
MIN_PING_INTERVAL_MS = KEEPALIVE_TIME_MS // 2  # what a server allows (timer jitter margin)
MESH_MESSAGE_BYTES = 64 * 1024 * 1024  # the mesh ports' message limit, each way


class MessageTooLarge(ValueError):
    """A message over MESH_MESSAGE_BYTES, refused by the sender before any of it was sent (its
    call goes on): the peer would have failed the whole call for it, and with the call every
    message queued behind it (`BatchedStream` splits the batch instead)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"a message of {size} bytes, over the mesh's limit of "
                         f"{MESH_MESSAGE_BYTES} bytes")
        self.size = size

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.max_receive_message_length", MESH_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MESH_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
]


class ChannelPool:
    """One grpc.aio channel per peer address, all with the mesh's mTLS credentials.

    An address found by resolving a DNS name (an IP) is verified against that name, not the IP:
    `get(address, server_name=name)` once, and every later `get(address)` (the callers that only
    know the address, e.g. from a route) gets the same channel. With `peer_name` (e.g.
    'meshlm-{role}'), `for_role` checks every peer against its role's name, so certificates
    name services, not the addresses containers and pods happen to get. With `streams_tls`,
    `stream_channel` gives the batched streams a native channel per address
    (common/native_grpc/client.py: the same names, the same keepalive bound)."""

    def __init__(self, credentials: grpc.ChannelCredentials, peer_name: str = "",
                 streams_tls: ssl.SSLContext | None = None) -> None:
        self._credentials = credentials
        self._peer_name = peer_name
        self._streams_tls = streams_tls  # set: batched streams go on native channels
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[str, NativeChannel] = {}
        self._names: dict[str, str] = {}
        self._retired: list[grpc.aio.Channel | NativeChannel] = []  # calls may still use them

    def name_for(self, role: str) -> str | None:
        """The name a `role` peer's certificate is checked against (--peer-tls-name with
        '{role}' filled in), or None to check it against its address."""
        return self._peer_name.replace("{role}", role) if self._peer_name else None

    def for_role(self, role: str, address: str) -> grpc.aio.Channel:
        """The channel to a `role` peer at `address` (its certificate names the role)."""
        return self.get(address, self.name_for(role))

    def get(self, address: str, server_name: str | None = None) -> grpc.aio.Channel:
        """The channel to `address`; `server_name` is the name its certificate must carry
        (default: the host of `address`). A new name replaces the address's channel."""
        if server_name is not None and self._names.get(address) != server_name:
            self._names[address] = server_name
            for channels in (self._channels, self._streams):
                old = channels.pop(address, None)
                if old is not None:
                    self._retired.append(old)
        channel = self._channels.get(address)
        if channel is None:
            options = list(CHANNEL_OPTIONS)
            if address in self._names:
                options.append(("grpc.ssl_target_name_override", self._names[address]))
            channel = grpc.aio.secure_channel(address, self._credentials, options=options)
            self._channels[address] = channel
        return channel

    def stream_channel(self, address: str) -> grpc.aio.Channel | NativeChannel:
        """The channel for batched streams to `address` (named as `get` named it): a native
        one (common/native_grpc/client.py) when the pool has `streams_tls`, else the grpc
        channel itself."""
        if self._streams_tls is None:
            return self.get(address)
        channel = self._streams.get(address)
        if channel is None:
            from meshlm.common.native_grpc.client import NativeChannel
            channel = NativeChannel(address, self._streams_tls, self._names.get(address))
            self._streams[address] = channel
        return channel

    async def discard(self, address: str) -> None:
        """Close and forget the channels to a peer that left (a later `get` opens new ones)."""
        self._names.pop(address, None)
        for channels in (self._channels, self._streams):
            channel = channels.pop(address, None)
            if channel is not None:
                await channel.close(grace=None)

    async def close(self) -> None:
        for channel in [*self._channels.values(), *self._streams.values(), *self._retired]:
            await channel.close(grace=None)
        self._channels.clear()
        self._streams.clear()
        self._retired.clear()
