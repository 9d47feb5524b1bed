"""What each overlay of deploy/k8s adds to the base: a GPU scheduler (the base stays CPU-only),
cert-manager certificates instead of the init Job's, and a PodMonitor for Prometheus. Custom
resources are checked field by field here (kubernetes-validate has no schema for them).

No cluster needed: nothing here talks to an API server.
"""

from __future__ import annotations

import pytest
from k8s_objects import (
    KUBECTL,
    ROLES,
    allowed_from,
    config,
    container_port,
    meshlm_containers,
    mounted_file,
    objects,
    pod_templates,
    quantity,
    render,
    role_deployment,
    selected_templates,
)

if KUBECTL is None:
    pytest.skip("kubectl is not installed: cannot render deploy/k8s with `kubectl kustomize`",
                allow_module_level=True)


def test_base_is_cpu_only():
    for _, template in pod_templates(render("base")):
        for c in template["spec"]["containers"]:
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
            assert "MESHLM_DEVICE" not in {e["name"] for e in c.get("env") or []}


def test_gpu_overlay():
    objs = render("gpu")
    template = role_deployment(objs, "scheduler")["spec"]["template"]
    (c,) = meshlm_containers(template)
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert {"name": "MESHLM_DEVICE", "value": "cuda"} in c["env"]
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule"
               for t in template["spec"]["tolerations"])
    shm = mounted_file(template, c, "/dev/shm/x")
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    # A memory-backed emptyDir is charged to the container's memory limit.
    assert quantity(c["resources"]["limits"]["memory"]) > quantity(shm[0]["emptyDir"]["sizeLimit"])
    for role in ("gateway", "tokenizer", "detokenizer"):
        (other,) = meshlm_containers(role_deployment(objs, role)["spec"]["template"])
        assert "nvidia.com/gpu" not in other["resources"]["limits"], role


def test_cert_manager_overlay():
    objs = render("cert-manager")
    issuers = {i["metadata"]["name"]: i for i in objects(objs, "Issuer")}
    certs = {c["metadata"]["name"]: c for c in objects(objs, "Certificate")}
    for obj in (*issuers.values(), *certs.values()):
        assert obj["apiVersion"] == "cert-manager.io/v1"
    ca = certs.pop("meshlm-ca")
    assert ca["spec"]["isCA"] is True
    assert "selfSigned" in issuers[ca["spec"]["issuerRef"]["name"]]["spec"]
    assert issuers["meshlm-ca"]["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    assert set(certs) == {f"meshlm-{r}-tls" for r in (*ROLES, "redis")}
    for name, cert in certs.items():
        spec = cert["spec"]
        assert spec["secretName"] == name
        assert spec["issuerRef"] == {"group": "cert-manager.io", "kind": "Issuer",
                                     "name": "meshlm-ca"}
        assert {"server auth", "client auth"} <= set(spec["usages"]), name
        assert (spec["privateKey"]["algorithm"], spec["privateKey"]["size"]) == ("ECDSA", 256)
        assert spec["dnsNames"], name


def test_observability_overlay():
    objs = render("observability")
    cfg = config(objs)
    assert cfg["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith(("http://", "https://"))
    (monitor,) = objects(objs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    pods = selected_templates(objs, monitor["spec"]["selector"])
    roles = {t["metadata"]["labels"]["app.kubernetes.io/component"] for _, t in pods}
    assert roles == set(ROLES)
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint.get("path", "/metrics") == "/metrics"
        for _, template in pods:
            assert container_port(template, endpoint["port"]) == int(cfg["MESHLM_METRICS_PORT"])
    # Prometheus is not a mesh pod: some policy must let it reach the metrics port.
    port = int(cfg["MESHLM_METRICS_PORT"])
    for _, template in pods:
        froms = allowed_from(objs, template["metadata"]["labels"], port)
        assert any(f and any("namespaceSelector" in peer for peer in f) for f in froms)
