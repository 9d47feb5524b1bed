"""The security of deploy/k8s, for the base and every overlay: pod and container security
contexts, and NetworkPolicies vs. the ports every pod declares (public ports open, the rest
reachable from the mesh only).

No cluster needed: nothing here talks to an API server.
"""

from __future__ import annotations

import pytest
from k8s_objects import (
    KUBECTL,
    MESH_LABEL,
    allowed_from,
    meshlm_containers,
    mounted_file,
    objects,
    pod_templates,
    render,
    selector_matches,
)

if KUBECTL is None:
    pytest.skip("kubectl is not installed: cannot render deploy/k8s with `kubectl kustomize`",
                allow_module_level=True)


def test_pod_security(target):
    for workload, template in pod_templates(render(target)):
        name, spec = workload["metadata"]["name"], template["spec"]
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True, name
        assert (psc["runAsUser"], psc["runAsGroup"], psc["fsGroup"]) == (10001, 10001, 10001), name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        is_init = workload["kind"] == "Job"
        assert spec["automountServiceAccountToken"] is is_init, name
        if is_init:
            assert spec["serviceAccountName"] == "meshlm-init"
        for c in spec["containers"]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert csc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert csc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), (name, c["name"])
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), (name, c["name"])
        for c in meshlm_containers(template):
            tmp = mounted_file(template, c, "/tmp/x")
            assert tmp and "emptyDir" in tmp[0], f"{name}: /tmp must be a writable emptyDir"


def test_network_policies(target):
    objs = render(target)
    mesh_only = [{"podSelector": {"matchLabels": dict([MESH_LABEL])}}]
    public = {30000, 40000}
    for workload, template in pod_templates(objs):
        labels = template["metadata"]["labels"]
        name = workload["metadata"]["name"]
        denied = [p for p in objects(objs, "NetworkPolicy")
                  if selector_matches(p["spec"]["podSelector"], labels)
                  and "Ingress" in p["spec"].get("policyTypes", [])]
        assert denied, f"{name}: no ingress policy selects it (everything open)"
        for c in template["spec"]["containers"]:
            for p in c.get("ports") or []:
                port = p["containerPort"]
                froms = allowed_from(objs, labels, port)
                if port in public:
                    assert None in froms, f"{name}:{port} must be reachable from anywhere"
                else:
                    assert None not in froms, f"{name}:{port} is open to everyone"
                    assert mesh_only in froms, f"{name}:{port} unreachable from the mesh"
