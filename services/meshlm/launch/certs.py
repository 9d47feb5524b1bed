"""Development certificates: a private CA, the mesh identity every service shares, and a public
server certificate for the gateway. For local runs and tests only; production brings its own PKI.

    ca.pem / ca.key          the CA (EC P-256), trusted by every service and by test clients
    mesh.pem / mesh.key      serverAuth + clientAuth, SANs for loopback and the service names
    server.pem / server.key  serverAuth for the gateway's public port (localhost, 127.0.0.1, ::1)

`ensure_dev_certs` reuses files that are present, parse, chain to the CA, cover the wanted SANs
and stay valid for at least another day; otherwise it writes new ones (a new CA means new leaves).
Writes are atomic and serialized by a lock file, so concurrent callers are safe.

    python -m meshlm.launch.certs DIR [--san HOST ...]
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import ipaddress
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import click
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshlm.common.tls import MeshTLS

VALIDITY = dt.timedelta(days=365)
BACKDATE = dt.timedelta(minutes=5)  # tolerate clock skew between processes / machines
RENEW_BEFORE = dt.timedelta(days=1)

MESH_DNS = (
    "localhost", "gateway", "tokenizer", "scheduler", "detokenizer",
    "meshlm-gateway", "meshlm-tokenizer", "meshlm-scheduler", "meshlm-detokenizer",
)
SERVER_DNS = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")

Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class DevCerts:
    """Paths of the development PEM files in one directory."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def mesh_cert(self) -> Path:
        return self.directory / "mesh.pem"

    @property
    def mesh_key(self) -> Path:
        return self.directory / "mesh.key"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.directory / "server.key"

    def mesh_tls(self) -> MeshTLS:
        return MeshTLS(str(self.ca_cert), str(self.mesh_cert), str(self.mesh_key))

    def mesh_flags(self) -> list[str]:
        """`--mesh-ca X --mesh-cert Y --mesh-key Z` for a service's command line."""
        return ["--mesh-ca", str(self.ca_cert), "--mesh-cert", str(self.mesh_cert),
                "--mesh-key", str(self.mesh_key)]


def ensure_dev_certs(
    directory: Path, extra_sans: Sequence[str] = (), *, now: dt.datetime | None = None
) -> DevCerts:
    """Make (or reuse) the CA, mesh and server certificates under `directory`.

    `extra_sans` (host names or IP addresses) are added to both leaf certificates, e.g. the
    non-loopback address services bind to. `now` exists for tests (certificates "issued then").
    """
    certs = DevCerts(Path(directory))
    certs.directory.mkdir(parents=True, exist_ok=True)
    now = now or dt.datetime.now(dt.UTC)
    mesh_sans = _sans([*MESH_DNS, *LOOPBACK_IPS, *extra_sans])
    server_sans = _sans([*SERVER_DNS, *LOOPBACK_IPS, *extra_sans])
    with _locked(certs.directory / ".lock"):
        ca = _load(certs.ca_cert, certs.ca_key, None, None, now)
        if ca is None:
            ca = _write_ca(certs, now)
        ca_cert, ca_key = ca
        for cert_path, key_path, sans, usages in (
            (certs.mesh_cert, certs.mesh_key, mesh_sans,
             [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            (certs.server_cert, certs.server_key, server_sans, [ExtendedKeyUsageOID.SERVER_AUTH]),
        ):
            if _load(cert_path, key_path, ca_cert, sans, now) is None:
                cn = cert_path.stem
                leaf, key = _issue(ca_cert, ca_key, f"meshlm {cn}", sans, usages, now)
                _write(cert_path, key_path, leaf, key)
    return certs


def _sans(names: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in dict.fromkeys(n.strip("[]") for n in names if n.strip("[]")):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def _load(
    cert_path: Path,
    key_path: Path,
    issuer: x509.Certificate | None,
    sans: list[x509.GeneralName] | None,
    now: dt.datetime,
) -> tuple[x509.Certificate, Key] | None:
    """The pair if it is usable as is: matching key, in validity, signed by issuer, SANs covered."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
            return None
        if cert.not_valid_before_utc > now or cert.not_valid_after_utc < now + RENEW_BEFORE:
            return None
        if issuer is not None:
            cert.verify_directly_issued_by(issuer)
        if sans is not None:
            have = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            if not set(sans) <= set(have):
                return None
    except (OSError, ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return None
    return cert, key


def _write_ca(certs: DevCerts, now: dt.datetime) -> tuple[x509.Certificate, Key]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshlm dev"),
        x509.NameAttribute(NameOID.COMMON_NAME, "meshlm dev CA"),
    ])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        _builder(name, name, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(certs.ca_cert, certs.ca_key, cert, key)
    return cert, key


def _issue(
    ca_cert: x509.Certificate,
    ca_key: Key,
    common_name: str,
    sans: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
    now: dt.datetime,
) -> tuple[x509.Certificate, Key]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshlm dev"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        _builder(subject, ca_cert.subject, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, now: dt.datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + VALIDITY)
    )


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
        encipher_only=False, decipher_only=False,
    )


def _write(cert_path: Path, key_path: Path, cert: x509.Certificate, key: Key) -> None:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _atomic_write(key_path, key_pem, 0o600)
    _atomic_write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not widen or narrow it
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@click.command(name="meshlm-certs")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--san", "sans", multiple=True, help="extra host name or IP for the leaf certs")
def cli(directory: Path, sans: tuple[str, ...]) -> None:
    """Create (or reuse) development certificates in DIRECTORY and print their paths."""
    certs = ensure_dev_certs(directory, sans)
    for label, path in (
        ("ca", certs.ca_cert), ("mesh cert", certs.mesh_cert), ("mesh key", certs.mesh_key),
        ("server cert", certs.server_cert), ("server key", certs.server_key),
    ):
        click.echo(f"{label:12} {path}")


if __name__ == "__main__":
    cli()
