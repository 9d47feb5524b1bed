"""deploy/k8s rendered offline (`kubectl kustomize`, cached per target) and lookups in the
rendered objects, for the static checks test_k8s_manifests.py, test_k8s_wiring.py,
test_k8s_security.py and test_k8s_overlays.py."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import yaml

KUBECTL = shutil.which("kubectl")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
TARGETS = {
    "base": K8S / "base",
    "gpu": K8S / "overlays" / "gpu",
    "cert-manager": K8S / "overlays" / "cert-manager",
    "observability": K8S / "overlays" / "observability",
}
ROLES = ("gateway", "tokenizer", "scheduler", "detokenizer")
MESH_LABEL = ("meshlm.dev/mesh", "true")
IMAGE = "meshlm/meshlm"


@functools.cache
def render_dir(path: Path) -> tuple[dict, ...]:
    proc = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def render(target: str) -> tuple[dict, ...]:
    return render_dir(TARGETS[target])


def objects(objs, kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs, kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def config(objs) -> dict[str, str]:
    return one(objs, "ConfigMap", "meshlm-config")["data"]


def pod_templates(objs) -> list[tuple[dict, dict]]:
    """(workload, pod template) for every Deployment and Job."""
    return [(o, o["spec"]["template"]) for o in objs if o["kind"] in ("Deployment", "Job")]


def deployments(objs) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects(objs, "Deployment")}


def role_deployment(objs, role: str) -> dict:
    return one(objs, "Deployment", f"meshlm-{role}")


def meshlm_containers(template: dict) -> list[dict]:
    return [c for c in template["spec"]["containers"] if c["image"].split(":")[0] == IMAGE]


def selector_matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against a label set."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def selected_templates(objs, selector: dict) -> list[tuple[dict, dict]]:
    return [(w, t) for w, t in pod_templates(objs)
            if selector_matches(selector, t["metadata"].get("labels") or {})]


def container_port(template: dict, port) -> int | None:
    """The number of a container port given by number or by name, if the pod has it."""
    for c in template["spec"]["containers"]:
        for p in c.get("ports") or []:
            if port in (p["containerPort"], p.get("name")):
                return p["containerPort"]
    return None


def quantity(q) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "m": 1e-3}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m, f"unparsable quantity {q!r}"
    return float(m[1]) * units.get(m[2], 1)


def mounted_file(template: dict, container: dict, path: str) -> tuple[dict, str] | None:
    """(volume, key) when `path` is a file inside one of the container's volume mounts."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes") or []}
    for m in container.get("volumeMounts") or []:
        prefix = m["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            return volumes[m["name"]], path[len(prefix):]
    return None


def allowed_from(objs, labels: dict, port: int) -> list[list | None]:
    """The `from` lists of the NetworkPolicy ingress rules that admit `port` to pods with `labels`
    (None: from anywhere)."""
    out = []
    for pol in objects(objs, "NetworkPolicy"):
        if not selector_matches(pol["spec"]["podSelector"], labels):
            continue
        for rule in pol["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports is None or any(p.get("port") == port for p in ports):
                out.append(rule.get("from"))
    return out
