"""TLS credentials for gRPC: mutual TLS between mesh services, optional TLS on public ports.

Every file is read once, when the credentials are built; a missing or unreadable file is a
`ValueError` that names the flag it came from (`--mesh-ca: cannot read '/x/ca.pem': ...`), so a
service fails at start-up with a message the operator can act on.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc


def read_pem(path: str | Path, flag: str) -> bytes:
    """The bytes of a PEM file; ValueError naming `flag` when it is unset, unreadable or not PEM."""
    if not str(path):
        raise ValueError(f"{flag} is required")
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {str(path)!r}: {e.strerror or e}") from e
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: {str(path)!r} is not a PEM file")
    return data


def server_credentials(
    cert: str | Path,
    key: str | Path,
    client_ca: str | Path | None = None,
    require_client_auth: bool = False,
    *,
    flag_prefix: str = "tls",
) -> grpc.ServerCredentials:
    """Credentials for a TLS server port.

    `client_ca` (optional) is the CA that client certificates must chain to; with
    `require_client_auth` a client without a valid certificate is refused at the handshake.
    Errors name the flags --{flag_prefix}-cert, --{flag_prefix}-key, --{flag_prefix}-client-ca.
    """
    chain, private_key, roots = _server_pems(cert, key, client_ca, require_client_auth,
                                             flag_prefix)
    return grpc.ssl_server_credentials(
        [(private_key, chain)], root_certificates=roots, require_client_auth=require_client_auth
    )


def _server_pems(cert: str | Path, key: str | Path, client_ca: str | Path | None,
                 require_client_auth: bool, flag_prefix: str
                 ) -> tuple[bytes, bytes, bytes | None]:
    """A server's certificate chain, key and client CA (PEM), read and checked; errors name
    the flags."""
    chain = read_pem(cert, f"--{flag_prefix}-cert")
    private_key = read_pem(key, f"--{flag_prefix}-key")
    roots = read_pem(client_ca, f"--{flag_prefix}-client-ca") if client_ca else None
    if require_client_auth and roots is None:
        raise ValueError(f"--{flag_prefix}-client-ca is required to verify client certificates")
    return chain, private_key, roots


def tls_context(
    cert: str | Path,
    key: str | Path,
    client_ca: str | Path | None = None,
    require_client_auth: bool = False,
    *,
    flag_prefix: str = "tls",
) -> ssl.SSLContext:
    """As server_credentials, for a server on asyncio's own TLS (the gateway's native gRPC
    port): HTTP/2 by ALPN, TLS 1.2 or newer."""
    _server_pems(cert, key, client_ca, require_client_auth, flag_prefix)  # the same checks
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert), str(key))
    context.set_alpn_protocols(["h2"])
    if client_ca:
        context.load_verify_locations(str(client_ca))
        context.verify_mode = ssl.CERT_REQUIRED if require_client_auth else ssl.CERT_OPTIONAL
    return context


def channel_credentials(
    ca: str | Path | None = None,
    cert: str | Path | None = None,
    key: str | Path | None = None,
    *,
    flag_prefix: str = "tls",
) -> grpc.ChannelCredentials:
    """Client TLS: trust `ca` (system roots when None); present `cert` and `key` if given."""
    roots = read_pem(ca, f"--{flag_prefix}-ca") if ca else None
    if bool(cert) != bool(key):
        raise ValueError(f"--{flag_prefix}-cert and --{flag_prefix}-key go together")
    chain = read_pem(cert, f"--{flag_prefix}-cert") if cert else None
    private_key = read_pem(key, f"--{flag_prefix}-key") if key else None
    return grpc.ssl_channel_credentials(
        root_certificates=roots, private_key=private_key, certificate_chain=chain
    )


def mesh_channel_credentials(
    ca: str | Path, cert: str | Path, key: str | Path
) -> grpc.ChannelCredentials:
    """mTLS client credentials for calls between mesh services (all three files required)."""
    return MeshTLS(str(ca), str(cert), str(key)).channel_credentials()


class _MeshFlags(Protocol):
    mesh_ca: str
    mesh_cert: str
    mesh_key: str


@dataclass(frozen=True)
class MeshTLS:
    """The mesh identity of one service: the CA every service trusts, and its own cert and key.

    One certificate serves both directions (server on the mesh port, client to its peers), so
    it carries both serverAuth and clientAuth usages. PEM files are read once, on first use.
    """

    ca: str
    cert: str
    key: str
    _pem: dict[str, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, config: _MeshFlags) -> MeshTLS:
        """From any config with `mesh_ca`, `mesh_cert`, `mesh_key` (e.g. ServiceConfig)."""
        return cls(config.mesh_ca, config.mesh_cert, config.mesh_key)

    def load(self) -> None:
        """Read and check all three files now (raises ValueError naming the bad flag)."""
        if not self._pem:
            self._pem.update(
                ca=read_pem(self.ca, "--mesh-ca"),
                cert=read_pem(self.cert, "--mesh-cert"),
                key=read_pem(self.key, "--mesh-key"),
            )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side of the mesh port: clients must present a cert signed by the mesh CA."""
        self.load()
        return grpc.ssl_server_credentials(
            [(self._pem["key"], self._pem["cert"])],
            root_certificates=self._pem["ca"],
            require_client_auth=True,
        )

    def server_context(self) -> ssl.SSLContext:
        """server_credentials for the native server (asyncio's TLS)."""
        self.load()  # errors name the --mesh-* flags
        return tls_context(self.cert, self.key, self.ca, True, flag_prefix="mesh")

    def client_context(self) -> ssl.SSLContext:
        """channel_credentials for the native client (asyncio's TLS): HTTP/2 by ALPN."""
        self.load()
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        context.set_alpn_protocols(["h2"])
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: trust only the mesh CA and present this service's certificate."""
        self.load()
        return grpc.ssl_channel_credentials(
            root_certificates=self._pem["ca"],
            private_key=self._pem["key"],
            certificate_chain=self._pem["cert"],
        )
