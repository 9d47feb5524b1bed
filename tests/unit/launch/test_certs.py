"""Dev certificates: chain, SANs, usages, reuse vs regeneration, and real TLS handshakes."""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshlm.common.tls import MeshTLS, channel_credentials, server_credentials
from meshlm.launch.certs import DevCerts, ensure_dev_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    return ensure_dev_certs(tmp_path_factory.mktemp("certs"))


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(path: Path) -> set[str]:
    ext = _cert(path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n.value) for n in ext}


def _ekus(path: Path) -> set[x509.ObjectIdentifier]:
    return set(_cert(path).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_files_exist_and_keys_are_private(certs: DevCerts) -> None:
    for path in (certs.ca_cert, certs.mesh_cert, certs.server_cert):
        assert path.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    for path in (certs.ca_key, certs.mesh_key, certs.server_key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_chain_verifies_for_server_and_client_use(certs: DevCerts) -> None:
    store = Store([_cert(certs.ca_cert)])
    for leaf in (certs.mesh_cert, certs.server_cert):
        for name in (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("::1"))):
            verifier = PolicyBuilder().store(store).build_server_verifier(name)
            chain = verifier.verify(_cert(leaf), [])
            assert chain[-1] == _cert(certs.ca_cert)
    PolicyBuilder().store(store).build_client_verifier().verify(_cert(certs.mesh_cert), [])


def test_sans_and_usages(certs: DevCerts) -> None:
    mesh = _sans(certs.mesh_cert)
    assert {"localhost", "gateway", "tokenizer", "scheduler", "detokenizer"} <= mesh
    assert {"127.0.0.1", "::1"} <= mesh
    assert _sans(certs.server_cert) >= {"localhost", "127.0.0.1", "::1"}
    assert _ekus(certs.mesh_cert) == {
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    }
    assert _ekus(certs.server_cert) == {ExtendedKeyUsageOID.SERVER_AUTH}
    ca = _cert(certs.ca_cert).extensions.get_extension_for_class(x509.BasicConstraints).value
    assert ca.ca
    validity = _cert(certs.mesh_cert).not_valid_after_utc - dt.datetime.now(dt.UTC)
    assert dt.timedelta(days=360) < validity <= dt.timedelta(days=366)


def test_existing_valid_files_are_reused(tmp_path: Path) -> None:
    first = ensure_dev_certs(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.glob("*.*")}
    ensure_dev_certs(tmp_path)
    assert {p: p.read_bytes() for p in tmp_path.glob("*.*")} == before
    # A missing leaf is reissued by the same CA; the other leaf is kept.
    ca, server = first.ca_cert.read_bytes(), first.server_cert.read_bytes()
    mesh = first.mesh_cert.read_bytes()
    first.mesh_cert.unlink()
    ensure_dev_certs(tmp_path)
    assert first.ca_cert.read_bytes() == ca and first.server_cert.read_bytes() == server
    assert first.mesh_cert.read_bytes() != mesh
    _cert(first.mesh_cert).verify_directly_issued_by(_cert(first.ca_cert))


def test_expired_ca_regenerates_everything(tmp_path: Path) -> None:
    old = ensure_dev_certs(tmp_path, now=dt.datetime.now(dt.UTC) - dt.timedelta(days=400))
    ca, mesh = old.ca_cert.read_bytes(), old.mesh_cert.read_bytes()
    new = ensure_dev_certs(tmp_path)
    assert new.ca_cert.read_bytes() != ca and new.mesh_cert.read_bytes() != mesh
    _cert(new.mesh_cert).verify_directly_issued_by(_cert(new.ca_cert))
    _cert(new.server_cert).verify_directly_issued_by(_cert(new.ca_cert))


def test_new_extra_san_reissues_leaves(tmp_path: Path) -> None:
    certs = ensure_dev_certs(tmp_path)
    ca = certs.ca_cert.read_bytes()
    ensure_dev_certs(tmp_path, ["10.9.8.7", "meshlm.internal"])
    assert certs.ca_cert.read_bytes() == ca
    assert {"10.9.8.7", "meshlm.internal"} <= _sans(certs.mesh_cert)


def _handshake(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str
) -> dict[str, Any]:
    """One TLS connection over loopback; returns what the server saw."""
    seen: dict[str, Any] = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(5)

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    seen["peer"] = tls.getpeercert()
                    tls.sendall(b"ok")
            except (OSError, ssl.SSLError) as e:
                seen["error"] = e

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=5) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
                    seen["reply"] = tls.recv(2)
        finally:
            thread.join(5)
    return seen


@pytest.mark.parametrize("hostname", ["localhost", "127.0.0.1"])
def test_tls_handshake_with_server_cert(certs: DevCerts, hostname: str) -> None:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certs.server_cert, certs.server_key)
    client = ssl.create_default_context(cafile=str(certs.ca_cert))
    assert _handshake(server, client, hostname)["reply"] == b"ok"


def test_tls_handshake_rejects_wrong_name_and_untrusted_ca(certs: DevCerts) -> None:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certs.server_cert, certs.server_key)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server, ssl.create_default_context(cafile=str(certs.ca_cert)), "example.com")
    untrusting = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    untrusting.load_default_certs()
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server, untrusting, "localhost")


def test_mutual_tls_handshake_with_mesh_cert(certs: DevCerts) -> None:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certs.mesh_cert, certs.mesh_key)
    server.load_verify_locations(certs.ca_cert)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.create_default_context(cafile=str(certs.ca_cert))
    client.load_cert_chain(certs.mesh_cert, certs.mesh_key)
    seen = _handshake(server, client, "scheduler")
    assert seen["reply"] == b"ok"
    assert dict(x[0] for x in seen["peer"]["subject"])["commonName"] == "meshlm mesh"


@pytest.fixture
def mesh_server(certs: DevCerts) -> Iterator[str]:
    """A gRPC server on the mesh credentials serving grpc.health.v1."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", certs.mesh_tls().server_credentials())
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _check(address: str, creds: grpc.ChannelCredentials) -> int:
    with grpc.secure_channel(address, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_grpc_mutual_tls(certs: DevCerts, mesh_server: str) -> None:
    assert _check(mesh_server, certs.mesh_tls().channel_credentials()) == (
        health_pb2.HealthCheckResponse.SERVING
    )
    with pytest.raises(grpc.RpcError) as err:  # no client certificate: refused
        _check(mesh_server, channel_credentials(certs.ca_cert))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_public_tls(certs: DevCerts) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port(
        "127.0.0.1:0", server_credentials(certs.server_cert, certs.server_key)
    )
    server.start()
    try:
        assert _check(f"127.0.0.1:{port}", channel_credentials(certs.ca_cert)) == (
            health_pb2.HealthCheckResponse.SERVING
        )
    finally:
        server.stop(None)


def test_missing_or_bad_files_name_the_flag(certs: DevCerts, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--mesh-ca is required"):
        MeshTLS("", str(certs.mesh_cert), str(certs.mesh_key)).server_credentials()
    with pytest.raises(ValueError, match="--mesh-key: cannot read"):
        MeshTLS(str(certs.ca_cert), str(certs.mesh_cert), str(tmp_path / "nope.key")).load()
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="--tls-cert: .* is not a PEM file"):
        server_credentials(tmp_path / "junk.pem", certs.server_key)
    with pytest.raises(ValueError, match="--tls-client-ca is required"):
        server_credentials(certs.server_cert, certs.server_key, None, require_client_auth=True)
