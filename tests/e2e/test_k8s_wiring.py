"""The wiring of deploy/k8s, for the base and every overlay: Services vs. pods vs. meshlm-config,
Secrets vs. whatever creates them (the meshlm-init Job or cert-manager), and the certificate and
password files meshlm-config points at vs. the mounted Secrets.

No cluster needed: nothing here talks to an API server.
"""

from __future__ import annotations

import re

import pytest
from k8s_objects import (
    KUBECTL,
    ROLES,
    config,
    container_port,
    meshlm_containers,
    mounted_file,
    objects,
    one,
    pod_templates,
    render,
    role_deployment,
    selected_templates,
)

if KUBECTL is None:
    pytest.skip("kubectl is not installed: cannot render deploy/k8s with `kubectl kustomize`",
                allow_module_level=True)


def test_internal_services_match_config(target):
    """Each dns:/// entry in meshlm-config names a headless Service whose port reaches the role's
    mesh port; the Redis URL names the Redis Service."""
    objs = render(target)
    cfg = config(objs)
    for role in ("tokenizer", "scheduler", "detokenizer"):
        m = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", cfg[f"MESHLM_{role.upper()}S"])
        assert m, cfg[f"MESHLM_{role.upper()}S"]
        host, port = m[1], int(m[2])
        svc = one(objs, "Service", host)
        assert svc["spec"]["clusterIP"] == "None", f"{host} must be headless (one address a pod)"
        assert svc["spec"].get("publishNotReadyAddresses", False) is False
        (sport,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
        (target_pod,) = selected_templates(objs, {"matchLabels": svc["spec"]["selector"]})
        assert target_pod[1]["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert container_port(target_pod[1], sport.get("targetPort", port)) == port
    m = re.fullmatch(r"rediss://([a-z0-9-]+):(\d+)/\d+", cfg["MESHLM_REDIS_URL"])
    assert m, cfg["MESHLM_REDIS_URL"]
    redis = one(objs, "Service", m[1])
    (rport,) = [p for p in redis["spec"]["ports"] if p["port"] == int(m[2])]
    (redis_pod,) = selected_templates(objs, {"matchLabels": redis["spec"]["selector"]})
    assert container_port(redis_pod[1], rport["targetPort"]) == int(m[2])
    args = redis_pod[1]["spec"]["containers"][0]["args"]
    assert args[args.index("--tls-port") + 1] == m[2] and args[args.index("--port") + 1] == "0"


def test_service_selectors_and_ports(target):
    objs = render(target)
    for svc in objects(objs, "Service"):
        name = svc["metadata"]["name"]
        pods = selected_templates(objs, {"matchLabels": svc["spec"]["selector"]})
        assert len(pods) == 1, f"Service {name} selects {len(pods)} workloads"
        for p in svc["spec"]["ports"]:
            assert container_port(pods[0][1], p.get("targetPort", p["port"])), (name, p)


def _init_secrets(job: dict) -> tuple[set[str], dict[str, list[str]]]:
    """Secrets the meshlm-init Job creates, and the DNS names of each role's certificate."""
    (c,) = job["spec"]["template"]["spec"]["containers"]
    cmd = c["command"] + (c.get("args") or [])
    assert cmd[:3] == ["python", "-m", "meshlm.launch.certs"]
    prefix = cmd[cmd.index("--k8s-secrets") + 1]
    names: dict[str, list[str]] = {}
    for i, arg in enumerate(cmd):
        if arg == "--service":
            role, _, dns = cmd[i + 1].partition("=")
            names[role] = dns.split(",")
    assert not ("--no-certs" in cmd and names), "--no-certs with --service"
    secrets = {f"{prefix}-{role}-tls" for role in names}
    if "--redis-password" in cmd:
        secrets.add(f"{prefix}-redis-auth")
    # $(VAR) in a command is expanded only from the container's own env; else it stays literal.
    env = {e["name"] for e in c.get("env") or []}
    for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(cmd)):
        assert var in env, f"$({var}) in the init Job's command is not in its env"
    return secrets, names


def test_secrets_have_a_creator(target):
    objs = render(target)
    cfg = config(objs)
    job_secrets, job_names = _init_secrets(one(objs, "Job", "meshlm-init"))
    certs = {c["spec"]["secretName"]: c for c in objects(objs, "Certificate")}
    assert not job_secrets & set(certs), "a Secret made by both the Job and cert-manager"
    if target == "cert-manager":
        assert not job_names and job_secrets == {"meshlm-redis-auth"}
        names = {s.removeprefix("meshlm-").removesuffix("-tls"): c["spec"]["dnsNames"]
                 for s, c in certs.items() if s != "meshlm-ca"}
    else:
        assert not certs
        names = job_names
    # Every peer verifies the certificate against MESHLM_PEER_TLS_NAME with {role} filled in.
    for role in (*ROLES, "redis"):
        assert cfg["MESHLM_PEER_TLS_NAME"].replace("{role}", role) in names[role], role
    produced = job_secrets | set(certs)
    for workload, template in pod_templates(objs):
        for v in template["spec"].get("volumes") or []:
            if "secret" in v:
                assert v["secret"]["secretName"] in produced, (workload["metadata"]["name"], v)
    # The Job may read and create what it makes.
    rules = one(objs, "Role", "meshlm-init")["rules"]
    for secret in job_secrets:
        for verb in ("get", "create"):
            assert any(verb in r["verbs"] and "secrets" in r["resources"]
                       and secret in r.get("resourceNames", [secret])
                       for r in rules), (secret, verb)
    binding = one(objs, "RoleBinding", "meshlm-init")
    assert binding["roleRef"]["name"] == "meshlm-init"
    assert {"kind": "ServiceAccount", "name": "meshlm-init"} in binding["subjects"]


def test_config_paths_are_mounted(target):
    """The certificate/password files meshlm-config points at are keys of mounted Secrets."""
    objs = render(target)
    cfg = config(objs)
    tls_keys = {"MESHLM_MESH_CA": "ca.crt", "MESHLM_MESH_CERT": "tls.crt",
                "MESHLM_MESH_KEY": "tls.key"}
    for role in ROLES:
        template = role_deployment(objs, role)["spec"]["template"]
        (c,) = meshlm_containers(template)
        wanted = dict(tls_keys)
        if role == "gateway":
            wanted |= {"MESHLM_REDIS_CA": "ca.crt", "MESHLM_REDIS_PASSWORD_FILE": "password"}
        for var, key in wanted.items():
            found = mounted_file(template, c, cfg[var])
            assert found and found[1] == key and "secret" in found[0], (role, var)
            if var != "MESHLM_REDIS_PASSWORD_FILE":
                assert found[0]["secret"]["secretName"] == f"meshlm-{role}-tls", (role, var)
    redis = role_deployment(objs, "redis")["spec"]["template"]
    (c,) = redis["spec"]["containers"]
    for path in [c["args"][0]] + [a for a in c["args"] if a.startswith("/etc/")]:
        assert mounted_file(redis, c, path), path
