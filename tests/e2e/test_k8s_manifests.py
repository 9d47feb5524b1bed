"""The Kubernetes manifests in deploy/k8s: the base and every overlay render offline with
`kubectl kustomize`, validate strictly against the Kubernetes API schemas (kubernetes-validate),
and their workloads hang together: names and labels, images, the roles' commands and ports,
probes and shutdown, HPAs/PDBs vs. Deployments. Wiring (Services, config, Secrets) is checked in
test_k8s_wiring.py, security in test_k8s_security.py, what each overlay adds in
test_k8s_overlays.py.

No cluster needed: nothing here talks to an API server.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from k8s_objects import (
    IMAGE,
    K8S,
    KUBECTL,
    MESH_LABEL,
    ROLES,
    config,
    container_port,
    deployments,
    meshlm_containers,
    objects,
    pod_templates,
    render,
    render_dir,
    role_deployment,
    selected_templates,
)

if KUBECTL is None:
    pytest.skip("kubectl is not installed: cannot render deploy/k8s with `kubectl kustomize`",
                allow_module_level=True)

# Oldest Kubernetes the manifests promise to work on; the newest the validator knows is added.
MIN_K8S = "1.30"
# Custom resources kubernetes-validate has no schema for: checked field by field in
# test_k8s_overlays.py instead.
CRD_KINDS = {
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
}


def test_top_level_renders_the_base():
    """`kubectl apply -k deploy/k8s` gives exactly the base."""
    assert render_dir(K8S) == render("base")


def _validator() -> list[str] | None:
    if importlib.util.find_spec("kubernetes_validate") is not None:
        return [sys.executable, "-m", "kubernetes_validate"]
    for candidate in (Path(sys.executable).with_name("kubernetes-validate"),
                      shutil.which("kubernetes-validate")):
        if candidate and Path(candidate).exists():
            return [str(candidate)]
    return None


def _k8s_versions() -> list[str]:
    versions = [MIN_K8S]
    try:
        from kubernetes_validate.utils import latest_version
    except ImportError:
        return versions
    latest = ".".join(latest_version().split(".")[:2])
    return versions if latest == MIN_K8S else [*versions, latest]


def test_validates_against_kubernetes_schemas(target, tmp_path):
    validator = _validator()
    if validator is None:
        pytest.skip("kubernetes-validate is not installed: "
                    "pip install 'kubernetes-validate>=1.30'")
    files = []
    for i, obj in enumerate(render(target)):
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue  # no schema: see test_k8s_overlays.py
        path = tmp_path / f"{i:02d}-{obj['kind']}-{obj['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(obj))
        files.append(str(path))
    versions = _k8s_versions()
    cmd = [*validator, "--strict"]
    for v in versions:
        cmd += ["-k", v]
    proc = subprocess.run([*cmd, *files], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    # A missing schema (a misspelt kind or apiVersion) is only a WARN with exit status 0.
    bad = [line for line in out.splitlines() if not line.startswith("INFO")]
    assert proc.returncode == 0 and not bad, "\n".join(bad) or out
    assert out.count(" passed ") == len(files) * len(versions), out


def test_only_known_custom_resources(target):
    for obj in render(target):
        group = obj["apiVersion"].rpartition("/")[0]
        if "." in group and not group.endswith(".k8s.io"):
            assert (obj["apiVersion"], obj["kind"]) in CRD_KINDS, obj["metadata"]["name"]


def test_names_labels_namespace(target):
    for obj in render(target):
        meta = obj["metadata"]
        assert meta["name"].startswith("meshlm-"), meta["name"]
        assert "namespace" not in meta, f"{meta['name']}: the namespace comes from kubectl -n"
        assert meta["labels"]["app.kubernetes.io/name"] == "meshlm", meta["name"]
    for workload, template in pod_templates(render(target)):
        labels = template["metadata"]["labels"]
        assert labels.get(MESH_LABEL[0]) == MESH_LABEL[1], workload["metadata"]["name"]
        assert labels["app.kubernetes.io/name"] == "meshlm"
        assert "app.kubernetes.io/component" in labels


def test_images(target):
    tag = "0.1.0-cuda" if target == "gpu" else "0.1.0"
    for workload, template in pod_templates(render(target)):
        for c in template["spec"]["containers"]:
            if workload["metadata"]["name"] == "meshlm-redis":
                assert c["image"] == "redis:7-alpine"
            else:
                assert c["image"] == f"{IMAGE}:{tag}", workload["metadata"]["name"]


def test_deployments_run_the_roles(target):
    objs = render(target)
    cfg = config(objs)
    for role in ROLES:
        template = role_deployment(objs, role)["spec"]["template"]
        assert template["metadata"]["labels"]["app.kubernetes.io/component"] == role
        (c,) = meshlm_containers(template)
        assert c["command"] == ["python", "-m", f"meshlm.{role}"]
        assert {"configMapRef": {"name": "meshlm-config"}} in c["envFrom"]
        env = {e["name"]: e for e in c.get("env") or []}
        assert env["MESHLM_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert container_port(template, "metrics") == int(cfg["MESHLM_METRICS_PORT"])
        assert container_port(template, "health") == int(cfg["MESHLM_HEALTH_PORT"])
    gateway = role_deployment(objs, "gateway")["spec"]["template"]
    assert container_port(gateway, "http") == int(cfg["MESHLM_HTTP_PORT"])
    assert container_port(gateway, "grpc") == int(cfg["MESHLM_GRPC_PORT"])


def test_probes_and_shutdown(target):
    objs = render(target)
    cfg = config(objs)
    health = int(cfg["MESHLM_HEALTH_PORT"])
    for name, deployment in deployments(objs).items():
        template = deployment["spec"]["template"]
        grace = template["spec"]["terminationGracePeriodSeconds"]
        assert grace > int(cfg["MESHLM_SHUTDOWN_GRACE"]), f"{name}: SIGKILL before the drain ends"
        for c in template["spec"]["containers"]:
            assert {"readinessProbe", "livenessProbe"} <= set(c), (name, c["name"])
        for c in meshlm_containers(template):
            role = template["metadata"]["labels"]["app.kubernetes.io/component"]
            startup = c["startupProbe"]
            assert startup["exec"]["command"] == ["python", "-m", "meshlm.health", role]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, name
            for probe in (c["readinessProbe"], c["livenessProbe"]):
                assert probe["grpc"]["port"] == health, name
        for c in template["spec"]["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = (c.get(probe) or {}).get("tcpSocket", {}).get("port")
                if port is not None:
                    assert container_port(template, port), (name, probe, port)


def test_hpas_and_pdbs(target):
    objs = render(target)
    deps = deployments(objs)
    hpas = objects(objs, "HorizontalPodAutoscaler")
    scaled = set()
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deps, ref
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert "replicas" not in deps[ref["name"]]["spec"], f"{ref['name']}: the HPA owns replicas"
        scaled.add(ref["name"])
    assert scaled == {"meshlm-gateway", "meshlm-tokenizer", "meshlm-detokenizer"}
    covered = set()
    for pdb in objects(objs, "PodDisruptionBudget"):
        pods = selected_templates(objs, pdb["spec"]["selector"])
        assert len(pods) == 1, f"PDB {pdb['metadata']['name']} selects {len(pods)} workloads"
        covered.add(pods[0][0]["metadata"]["name"])
    assert {f"meshlm-{r}" for r in ROLES} <= covered
