"""Development certificates: a private CA, the mesh identity every service shares, and a public
server certificate for the gateway. For local runs and tests only; production brings its own PKI.

    ca.pem / ca.key          the CA (EC P-256), trusted by every service and by test clients
    mesh.pem / mesh.key      serverAuth + clientAuth, SANs for loopback and the service names
    server.pem / server.key  serverAuth for the gateway's public port (localhost, 127.0.0.1, ::1)

`ensure_dev_certs` reuses files that are present, parse, chain to the CA, cover the wanted SANs
and stay valid for at least another day; otherwise it writes new ones (a new CA means new leaves).
Writes are atomic and serialized by a lock file, so concurrent callers are safe.

    python -m meshlm.launch.certs DIR [--san HOST ...]

For containers (compose's one-shot `certs` service, the Kubernetes init Job): one certificate
per service named by its DNS names, a Redis password, optionally stored as Kubernetes Secrets:

    python -m meshlm.launch.certs DIR --service scheduler=scheduler,meshlm-scheduler ...
        [--redis-password] [--k8s-secrets PREFIX]
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import ipaddress
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import click
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshlm.common.tls import MeshTLS
from meshlm.launch.mesh_secrets import (
    KubeSecrets,
    ensure_redis_password,
    redis_auth_secret,
    tls_secret,
)

VALIDITY = dt.timedelta(days=365)
BACKDATE = dt.timedelta(minutes=5)  # tolerate clock skew between processes / machines
RENEW_BEFORE = dt.timedelta(days=1)

MESH_DNS = (
    "localhost", "gateway", "tokenizer", "scheduler", "detokenizer",
    "meshlm-gateway", "meshlm-tokenizer", "meshlm-scheduler", "meshlm-detokenizer",
)
SERVER_DNS = ("localhost",)
MESH_USAGES = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
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

    def leaf(self, name: str) -> tuple[Path, Path]:
        """A leaf certificate's PEM and key paths: `<name>.pem`, `<name>.key`."""
        return self.directory / f"{name}.pem", self.directory / f"{name}.key"

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
    _ensure_leaves(certs, {
        "mesh": ([*MESH_DNS, *LOOPBACK_IPS, *extra_sans], MESH_USAGES),
        "server": ([*SERVER_DNS, *LOOPBACK_IPS, *extra_sans], [ExtendedKeyUsageOID.SERVER_AUTH]),
    }, now)
    return certs


def ensure_service_certs(directory: Path, services: Mapping[str, Sequence[str]], *,
                         now: dt.datetime | None = None) -> DevCerts:
    """The CA and one certificate per service, `<name>.pem` / `<name>.key`, valid for that
    service's names (serverAuth + clientAuth: it is both ends of mesh calls). Names, not
    addresses: peers check a certificate against the role's name (--peer-tls-name), so
    containers and pods can come and go on any IP without new certificates."""
    certs = DevCerts(Path(directory))
    _ensure_leaves(certs, {name: (sans, MESH_USAGES) for name, sans in services.items()}, now)
    return certs


def _ensure_leaves(certs: DevCerts,
                   leaves: Mapping[str, tuple[Sequence[str], list[x509.ObjectIdentifier]]],
                   now: dt.datetime | None) -> None:
    """The CA, and `<name>.pem` / `<name>.key` for each leaf: kept when still good, else new."""
    certs.directory.mkdir(parents=True, exist_ok=True)
    now = now or dt.datetime.now(dt.UTC)
    with _locked(certs.directory / ".lock"):
        ca = _load(certs.ca_cert, certs.ca_key, None, None, now)
        if ca is None:
            ca = _write_ca(certs, now)
        ca_cert, ca_key = ca
        for name, (names, usages) in leaves.items():
            sans = _sans(names)
            cert_path, key_path = certs.leaf(name)
            if _load(cert_path, key_path, ca_cert, sans, now) is None:
                leaf, key = _issue(ca_cert, ca_key, f"meshlm {name}", sans, usages, now)
                _write(cert_path, key_path, leaf, key)


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
@click.option("--san", "sans", multiple=True, help="extra host name or IP for the dev leaf certs")
@click.option("--service", "services", multiple=True, metavar="NAME=DNS[,DNS...]",
              help="instead of the dev pair: one certificate per service, <NAME>.pem/.key, "
                   "valid for these names (repeat per service)")
@click.option("--no-certs", is_flag=True, help="make no certificates (only --redis-password)")
@click.option("--redis-password", is_flag=True,
              help="also a random Redis password: redis-password and redis-auth.conf "
                   "('requirepass ...', for redis-server); kept when present")
@click.option("--k8s-secrets", "k8s_prefix", default="", metavar="PREFIX",
              help="then store them as Secrets in this pod's namespace, each only if absent: "
                   "PREFIX-<NAME>-tls (tls.crt, tls.key, ca.crt) and PREFIX-redis-auth "
                   "(password, redis.conf)")
def cli(directory: Path, sans: tuple[str, ...], services: tuple[str, ...], no_certs: bool,
        redis_password: bool, k8s_prefix: str) -> None:
    """Create (or reuse) certificates in DIRECTORY and print their paths."""
    wanted: dict[str, list[str]] = {}
    for item in services:
        name, _, names = item.partition("=")
        if not name or not names:
            raise click.BadParameter(f"{item!r}: expected NAME=DNS[,DNS...]",
                                     param_hint="--service")
        wanted[name] = [n for n in names.split(",") if n]
    made: list[tuple[str, Path]] = []
    certs = DevCerts(directory)
    if not no_certs and wanted:
        ensure_service_certs(directory, wanted)
        made += [(f"{name} cert", certs.leaf(name)[0]) for name in wanted]
    elif not no_certs:
        ensure_dev_certs(directory, sans)
        made += [("mesh cert", certs.mesh_cert), ("mesh key", certs.mesh_key),
                 ("server cert", certs.server_cert), ("server key", certs.server_key)]
    if not no_certs:
        made.insert(0, ("ca", certs.ca_cert))
    if redis_password:
        made.append(("redis pass", ensure_redis_password(directory)))
    for label, path in made:
        click.echo(f"{label:12} {path}")
    if k8s_prefix:
        kube = KubeSecrets(os.environ.get("POD_NAMESPACE", ""))
        stored = {f"{k8s_prefix}-{name}-tls": (tls_secret(certs.ca_cert, *certs.leaf(name)),
                                                "kubernetes.io/tls")
                  for name in (wanted if not no_certs else {})}
        if redis_password:
            stored[f"{k8s_prefix}-redis-auth"] = (redis_auth_secret(directory), "Opaque")
        for name, (data, kind) in stored.items():
            created = kube.create(name, data, kind)
            click.echo(f"secret       {kube.namespace}/{name} "
                       f"{'created' if created else 'exists, kept'}")


if __name__ == "__main__":
    cli()
