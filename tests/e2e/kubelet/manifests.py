"""The manifests as kubelet's side sees them: `kubectl kustomize deploy/k8s` rendered into the
test namespace, and the small Kubernetes rules the pods are planned with (`$(VAR)` expansion,
image names, selectors, quantities)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

KUBECTL = shutil.which("kubectl")

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
NAMESPACE = "meshlm-e2e"
CLUSTER_DOMAIN = "cluster.local"
# The manifests' image repositories; the test maps them onto local images (no registry here).
MESHLM_REPO = "meshlm/meshlm"
REDIS_REPO = "redis"


def render() -> list[dict]:
    proc = subprocess.run([KUBECTL, "kustomize", str(K8S)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {K8S} failed:\n{proc.stderr}"
    objs = [o for o in yaml.safe_load_all(proc.stdout) if o]
    for o in objs:  # what `kubectl apply -n NAMESPACE` does to namespaced objects
        o["metadata"].setdefault("namespace", NAMESPACE)
    return objs


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def image_repo(image: str) -> tuple[str, str]:
    """('meshlm/meshlm', '0.1.0') from 'meshlm/meshlm:0.1.0' (digests are not used here)."""
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return image, "latest"
    return name, tag


def selector_matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion (k8s.io/kubernetes third_party/forked/golang/expansion):
    `$(NAME)` -> its value, unknown names left as written, `$$` -> `$`."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1:]
            if rest[0] == "$":
                read, advance = "$", 1
            elif rest[0] == "(":
                end = rest.find(")", 1)
                if end == -1:
                    read, advance = "$(", 1
                else:
                    name = rest[1:end]
                    read, advance = env.get(name, f"$({name})"), end + 1
            else:
                read, advance = "$" + rest[0], 1
            out.append(read)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12}
    for suffix, factor in units.items():
        if str(quantity).endswith(suffix):
            return int(float(str(quantity)[: -len(suffix)]) * factor)
    return int(float(quantity))
