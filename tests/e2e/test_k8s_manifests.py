"""The Kubernetes manifests in deploy/k8s: the base and every overlay render offline with
`kubectl kustomize`, validate strictly against the Kubernetes API schemas (kubernetes-validate),
and hang together: probes, security contexts, Services vs. pods vs. meshlm-config, Secrets vs.
whatever creates them, NetworkPolicies vs. ports, HPAs/PDBs vs. Deployments.

No cluster needed: nothing here talks to an API server.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

KUBECTL = shutil.which("kubectl")
if KUBECTL is None:
    pytest.skip("kubectl is not installed: cannot render deploy/k8s with `kubectl kustomize`",
                allow_module_level=True)

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
TARGETS = {
    "base": K8S / "base",
    "gpu": K8S / "overlays" / "gpu",
    "cert-manager": K8S / "overlays" / "cert-manager",
    "observability": K8S / "overlays" / "observability",
}
# Oldest Kubernetes the manifests promise to work on; the newest the validator knows is added.
MIN_K8S = "1.30"
# Custom resources kubernetes-validate has no schema for: checked field by field below instead.
CRD_KINDS = {
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
}
ROLES = ("gateway", "tokenizer", "scheduler", "detokenizer")
MESH_LABEL = ("meshlm.dev/mesh", "true")
IMAGE = "meshlm/meshlm"


# --- rendering -----------------------------------------------------------------------------------

@functools.cache
def _render(path: Path) -> tuple[dict, ...]:
    proc = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def render(target: str) -> tuple[dict, ...]:
    return _render(TARGETS[target])


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


# --- every target --------------------------------------------------------------------------------

@pytest.fixture(params=list(TARGETS))
def target(request) -> str:
    return request.param


def test_top_level_renders_the_base():
    """`kubectl apply -k deploy/k8s` gives exactly the base."""
    assert _render(K8S) == render("base")


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
            continue  # no schema: see the overlay tests below
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


def _allowed_from(objs, labels: dict, port: int) -> list[list | None]:
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
                froms = _allowed_from(objs, labels, port)
                if port in public:
                    assert None in froms, f"{name}:{port} must be reachable from anywhere"
                else:
                    assert None not in froms, f"{name}:{port} is open to everyone"
                    assert mesh_only in froms, f"{name}:{port} unreachable from the mesh"


# --- overlays ------------------------------------------------------------------------------------

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
        froms = _allowed_from(objs, template["metadata"]["labels"], port)
        assert any(f and any("namespaceSelector" in peer for peer in f) for f in froms)
