"""Which replicas a gateway should have, as plain functions: parsing the role lists, ordering
static and discovered replicas, filtering stale heartbeats, and diffing what discovery wants
against what the gateway has. No I/O here (that is `mesh/discovery.py`), so all of it is
unit-tested in milliseconds.

A role list (`--schedulers` etc.) holds static `host:port` entries and DNS names,
`dns:///<name>:<port>` (gRPC's spelling) or `dns:<name>:<port>`: each address the name
resolves to (A and AAAA) becomes a replica `ip:port` (`[ip]:port` for IPv6), verified by TLS
against the name.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DnsName:
    """A role-list entry resolved again and again: every address of `name`, on `port`."""

    name: str
    port: int


def parse_entry(entry: str, flag: str = "") -> str | DnsName:
    """A static `host:port`, or the DNS name of a `dns:` entry. ValueError names the flag."""
    if not entry.startswith("dns:"):
        return entry
    rest = entry[len("dns:"):]
    if rest.startswith("//"):
        authority, _, rest = rest[2:].partition("/")
        if authority:
            raise ValueError(f"{flag}: {entry!r}: a DNS server in the entry is not supported; "
                             "use --dns-server")
    name, _, port = rest.rpartition(":")
    if not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: {entry!r} is not dns:///<name>:<port>")
    return DnsName(name.rstrip("."), int(port))


def split_entries(entries: Iterable[str], flag: str = "") -> tuple[list[str], list[DnsName]]:
    """A role list as (static addresses in order, DNS names)."""
    static: list[str] = []
    names: list[DnsName] = []
    for entry in entries:
        parsed = parse_entry(entry, flag)
        if isinstance(parsed, DnsName):
            names.append(parsed)
        else:
            static.append(parsed)
    return static, names


def replica_address(ip: str, port: int) -> str:
    """host:port to dial a resolved address: IPv6 in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def address_order(address: str) -> tuple[int, int, int, str, int]:
    """Sort key: IP addresses numerically (10.0.0.9 before 10.0.0.10), IPv4 first, then host
    names; then the port. Every gateway sorts the same set the same way."""
    host, _, port = address.rpartition(":")
    port_number = int(port) if port.isdigit() else 0
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return 1, 0, 0, host, port_number
    return 0, ip.version, int(ip), "", port_number


def ordered(static: Sequence[str], discovered: Iterable[str]) -> list[str]:
    """A role's replicas in dp-rank order: static entries as configured, then discovered ones
    (not already static) sorted, so gateways that see the same replicas agree on ranks."""
    known = set(static)
    return [*dict.fromkeys(static), *sorted({a for a in discovered if a not in known},
                                            key=address_order)]


def live_members(expiries: Mapping[str, float], now: float) -> set[str]:
    """The announced addresses whose heartbeat has not expired at `now` (score = expiry)."""
    return {address for address, expiry in expiries.items() if expiry > now}


def wanted(members: Iterable[str], answers: Mapping[DnsName, Iterable[str]]
           ) -> dict[str, str | None]:
    """Every replica discovery wants for a role: address -> the name its certificate is
    checked against (None: its own host). Heartbeat members, and each DNS name's resolved
    addresses (which take the name: a pod IP is rarely in a certificate)."""
    out: dict[str, str | None] = dict.fromkeys(members)
    for dns_name, addresses in answers.items():
        for address in addresses:
            out[address] = dns_name.name
    return out


def diff(known: Iterable[str], want: Mapping[str, str | None]
         ) -> tuple[dict[str, str | None], list[str]]:
    """(to add with their server names, to remove), both in dp-rank order. A known replica
    stays as it is (a new server name for it would fail its requests for nothing)."""
    have = set(known)
    add = {a: want[a] for a in sorted(set(want) - have, key=address_order)}
    remove = sorted(have - set(want), key=address_order)
    return add, remove
