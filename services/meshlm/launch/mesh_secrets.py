"""The secrets a containerised mesh needs besides certificates, and storing them in Kubernetes.

`ensure_redis_password(DIR)`: a random password in `redis-password` and the same as
`redis-auth.conf` (`requirepass ...`), a file `redis-server` takes as its config, so the password
is on no command line. Kept when present.

`store_k8s_secrets(...)`: from inside a pod (the init Job), create each Secret in the pod's
namespace unless it exists, through the API server with the pod's service account; for a
`kubectl apply -k` without cert-manager. Stdlib only: no Kubernetes client library in the image.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

PASSWORD_FILE = "redis-password"
REDIS_CONF_FILE = "redis-auth.conf"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def ensure_redis_password(directory: Path) -> Path:
    """`DIR/redis-password` (made if absent, 0600) and `DIR/redis-auth.conf` to match."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PASSWORD_FILE
    if not path.exists() or not path.read_text().strip():
        _write_private(path, secrets.token_urlsafe(32) + "\n")
    password = path.read_text().strip()
    _write_private(directory / REDIS_CONF_FILE, f"requirepass {password}\n")
    return path


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def tls_secret(ca: Path, cert: Path, key: Path) -> dict[str, bytes]:
    """cert-manager's layout of a TLS Secret: tls.crt, tls.key, ca.crt."""
    return {"tls.crt": cert.read_bytes(), "tls.key": key.read_bytes(), "ca.crt": ca.read_bytes()}


def redis_auth_secret(directory: Path) -> dict[str, bytes]:
    return {"password": (directory / PASSWORD_FILE).read_bytes().strip(),
            "redis.conf": (directory / REDIS_CONF_FILE).read_bytes()}


class KubeSecrets:
    """Create-if-absent for Secrets in this pod's namespace (in-cluster service account)."""

    def __init__(self, namespace: str = "") -> None:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("--k8s-secrets runs inside a Kubernetes pod "
                               "(KUBERNETES_SERVICE_HOST is not set)")
        host = f"[{host}]" if ":" in host else host
        self.namespace = namespace or (SERVICE_ACCOUNT / "namespace").read_text().strip()
        self._base = f"https://{host}:{port}/api/v1/namespaces/{self.namespace}/secrets"
        self._token = (SERVICE_ACCOUNT / "token").read_text().strip()
        self._ssl = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))

    def create(self, name: str, data: Mapping[str, bytes], kind: str = "Opaque") -> bool:
        """True if created, False if a Secret of that name exists already (kept as it is)."""
        body = {"apiVersion": "v1", "kind": "Secret", "type": kind,
                "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "meshlm"}},
                "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}
        request = urllib.request.Request(
            self._base, data=json.dumps(body).encode(), method="POST",
            headers={"Authorization": f"Bearer {self._token}",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=self._ssl, timeout=30):
                return True
        except urllib.error.HTTPError as e:
            if e.code == 409:
                return False
            raise RuntimeError(f"creating Secret {self.namespace}/{name}: HTTP {e.code} "
                               f"{e.read().decode(errors='replace')[:300]}") from e
