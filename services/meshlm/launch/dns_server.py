"""A throwaway DNS server on a loopback port, for tests of DNS discovery (a stand-in for a
Kubernetes headless service whose pods come and go).

    with LoopbackDns({"schedulers.meshlm.test": ["127.0.0.2", "127.0.0.3"]}) as dns:
        gateway flags: --schedulers dns:///schedulers.meshlm.test:PORT --dns-server dns.address
        dns.set("schedulers.meshlm.test", ["127.0.0.2"])   # one pod left

It answers A and AAAA queries (UDP) for the names it holds, NXDOMAIN for others, and SERVFAIL
for everything while `failing` is set. Needs `dnslib` (the dev extra).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

TTL = 1  # seconds; discovery asks again every interval anyway


class _Records(BaseResolver):  # type: ignore[misc]
    def __init__(self) -> None:
        self.names: dict[str, list[str]] = {}
        self.failing = False
        self.queries = 0

    def resolve(self, request: Any, handler: Any) -> Any:
        self.queries += 1
        reply = request.reply()
        if self.failing:
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        name = str(request.q.qname).rstrip(".").lower()
        ips = self.names.get(name)
        if ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        qtype = QTYPE[request.q.qtype]
        for ip in ips:
            version = ipaddress.ip_address(ip).version
            if (qtype, version) == ("A", 4):
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=TTL))
            elif (qtype, version) == ("AAAA", 6):
                reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA(ip), ttl=TTL))
        return reply  # no record of the asked type: NOERROR with an empty answer


class LoopbackDns:
    def __init__(self, names: Mapping[str, Iterable[str]] | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self._records = _Records()
        for name, ips in (names or {}).items():
            self.set(name, ips)
        self._host, self._port = host, port
        self._server: DNSServer | None = None

    @property
    def address(self) -> str:
        """host:port for --dns-server."""
        assert self._server is not None, "not started"
        host, port = self._server.server.server_address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def queries(self) -> int:
        """Queries answered so far (a test can wait for the next resolution round)."""
        return self._records.queries

    @property
    def failing(self) -> bool:
        return self._records.failing

    @failing.setter
    def failing(self, value: bool) -> None:
        self._records.failing = value

    def set(self, name: str, ips: Iterable[str]) -> None:
        """The addresses `name` resolves to from now on (an empty list: NOERROR, no records)."""
        self._records.names[name.rstrip(".").lower()] = [str(ipaddress.ip_address(ip))
                                                          for ip in ips]

    def remove(self, name: str) -> None:
        """`name` no longer exists (NXDOMAIN)."""
        self._records.names.pop(name.rstrip(".").lower(), None)

    def start(self) -> LoopbackDns:
        quiet = DNSLogger(log="-recv,-send,-request,-reply,-truncated,-error,-data",
                          logf=lambda _: None)
        self._server = DNSServer(self._records, address=self._host, port=self._port,
                                 logger=quiet)
        self._server.start_thread()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server.server.server_close()
            self._server = None

    def __enter__(self) -> LoopbackDns:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

