"""The Kubernetes base (`kubectl kustomize deploy/k8s`) run for real: this test plays kubelet,
kube-dns and the API server's Secret store with plain Docker, so the wiring the manifests
describe (names, ports, certificate names, DNS discovery through headless Services, Secrets,
security contexts, probes) is exercised end to end, not only parsed.

- Every Deployment's pods run as containers on one Docker network the test creates, with the
  manifests' OWN image, command, args, env (envFrom the ConfigMap, downward API, `$(VAR)`
  expansion, Service link variables as kubelet injects them), Secret volumes (files, modes,
  fsGroup ownership), emptyDirs (tmpfs), securityContext (user, group, fsGroup,
  readOnlyRootFilesystem, capabilities, allowPrivilegeEscalation) and memory limits. The
  scheduler Deployment is scaled to 2, as `kubectl scale` would.
- DNS: each pod gets kubelet's resolv.conf (search `<ns>.svc.cluster.local svc.cluster.local
  cluster.local`, ndots:5) and each Service's FQDN `<svc>.<ns>.svc.cluster.local` is a network
  alias of every pod its selector matches, so a headless Service answers with every pod IP, as
  CoreDNS does. Short names (`meshlm-scheduler`, `meshlm-redis.<ns>`) resolve only through the
  search list, as in a cluster: a client that skipped it would fail here too.
- Secrets: the init Job's container runs with its exact command and args except the
  `--k8s-secrets PREFIX` pair (there is no API server: the upload is the only part not
  exercised); then the same CLI, with those args, runs again over the Job's output with the
  API client replaced by a recorder, and what it would have uploaded becomes each pod's Secret
  volume. So Secret names and keys come from the code the Job runs.
- Probes: startup exec probes run in the pod (`docker exec`, the container's env) until they
  pass; readiness/liveness gRPC and TCP probes are checked from outside the pod, as kubelet does.
- Then a streaming TextGenerate and an HTTP /generate go through the gateway Service's name,
  GetLoad shows both schedulers (DNS discovery found both addresses of the headless name), the
  gateway's log shows it verifies them against the name `meshlm-scheduler`, and a mesh call
  expecting a wrong name is refused.

Not emulated: NetworkPolicies (no CNI here; test_k8s_manifests.py checks them statically), CPU
requests/limits (throttling only slows the test, and the scheduler's limit of 4 CPUs is more
than `docker run --cpus` accepts on a 2-core machine), HPAs/PDBs, restarts (any crash fails the
test instead), and DNS publishing only Ready pods (aliases exist from container start; the
gateway's health watch uses a replica only once it is SERVING, so the difference is timing).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator

import pytest
from containers import REDIS_IMAGE, docker, require_docker
from kubelet.cluster import STARTUP_DEADLINE, Cluster
from kubelet.manifests import KUBECTL, MESHLM_REPO, REDIS_REPO, image_repo, render
from kubelet.snippets import CLIENT_SNIPPET

if KUBECTL is None:
    pytest.skip("kubectl is not installed: cannot render deploy/k8s with `kubectl kustomize`",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(900)  # the first test pays for the image build and pod start


@pytest.fixture(scope="module")
def cluster(meshlm_image: str) -> Iterator[Cluster]:
    require_docker()
    objs = render()
    images = {MESHLM_REPO: meshlm_image, REDIS_REPO: REDIS_IMAGE}
    used = {image_repo(c["image"]) for o in objs if o["kind"] in ("Deployment", "Job")
            for c in o["spec"]["template"]["spec"]["containers"]}
    # A renamed image in the manifests must fail here, not silently run something else.
    assert {repo for repo, _ in used} == set(images), f"the manifests' images changed: {used}"
    # Nothing is ever pulled (`--pull never` everywhere): the stand-in must be local.
    assert docker("image", "inspect", REDIS_IMAGE, check=False).returncode == 0, \
        f"{REDIS_IMAGE} is not a local image: point MESHLM_TEST_REDIS_IMAGE at one (redis 7)"
    redis_tag = next(tag for repo, tag in used if repo == REDIS_REPO)
    major = re.match(r"\d+", redis_tag)
    version = docker("run", "--pull", "never", "--rm", "--network", "none", "--entrypoint",
                     "redis-server", REDIS_IMAGE, "--version", timeout=60).stdout
    assert major and f" v={major[0]}." in version, \
        f"the manifests run redis:{redis_tag}; {REDIS_IMAGE} stands in with {version}"

    c = Cluster(objs, images)
    try:
        with c.dump_on_failure():
            t0 = time.monotonic()
            c.make_network()
            c.plan()
            prefix = c.run_job()
            stored = c.make_secrets(prefix)
            for pod in c.pods:
                for m in pod.secret_mounts:
                    assert m.secret in stored, (
                        f"pod {pod.name} mounts Secret {m.secret}, which the init Job does not "
                        f"make (it makes {sorted(stored)})")
            for name, s in stored.items():
                if s["type"] == "kubernetes.io/tls":  # the API server requires these keys
                    assert {"tls.crt", "tls.key"} <= set(s["keys"]), (name, s)
            c.timings["secrets"] = time.monotonic() - t0
            t1 = time.monotonic()
            c.start_pods()
            deadline = time.monotonic() + STARTUP_DEADLINE
            started = c.startup_probes(deadline)
            c.timings["startup"] = time.monotonic() - t1
            c.readiness = c.wait_ready()
            c.timings["ready"] = time.monotonic() - t1
            print(f"\nsecrets {c.timings['secrets']:.1f} s; pods started in "
                  f"{c.timings['startup']:.1f} s, ready in {c.timings['ready']:.1f} s; "
                  f"startup probes: { {k: round(v, 1) for k, v in started.items()} }")
        yield c
    finally:
        c.cleanup()


@pytest.fixture(scope="module")
def client_result(cluster: Cluster) -> dict:
    schedulers = cluster.pods_by_role("scheduler")
    grpc_port = cluster.service_port("meshlm-gateway", "grpc")
    http_port = cluster.service_port("meshlm-gateway", "http")
    with cluster.dump_on_failure():
        r = cluster.client(CLIENT_SNIPPET, env={
            # the short Service name, resolved through the pod's search list
            "GATEWAY_GRPC": f"meshlm-gateway:{grpc_port}",
            "GATEWAY_HTTP": f"http://meshlm-gateway:{http_port}",
            "SCHEDULERS": str(len(schedulers))})
        assert r.returncode == 0, f"client failed:\n{r.stdout}\n{r.stderr}"
        line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
        return json.loads(line[len("RESULT "):])


# --- tests ----------------------------------------------------------------------------------------

def test_pods_start_and_stay_up(cluster: Cluster):
    """Every pod passed its startup probe and kubelet's readiness/liveness checks, runs as the
    manifests say, and nothing restarted or exited."""
    with cluster.dump_on_failure():
        assert len(cluster.pods_by_role("scheduler")) == 2
        assert all(v[0] == 0 for v in cluster.readiness.values()), cluster.readiness
        for pod in cluster.pods:
            cluster.assert_running(pod)
            info = json.loads(docker("inspect", pod.container).stdout)[0]
            assert info["RestartCount"] == 0, pod.name
            assert info["HostConfig"]["ReadonlyRootfs"], pod.name
            assert info["HostConfig"]["CapDrop"] == ["ALL"], pod.name
            psc = pod.spec.get("securityContext") or {}
            csc = pod.main.get("securityContext") or {}
            user = csc.get("runAsUser", psc.get("runAsUser"))
            group = csc.get("runAsGroup", psc.get("runAsGroup"))
            assert info["Config"]["User"] == f"{user}:{group}", pod.name


def test_streaming_generate_through_the_gateway_service(client_result: dict):
    stream = client_result["stream"]
    texts = [m for m in stream if m["text"]]
    assert len(texts) >= 2, f"expected several streamed messages: {stream}"
    assert stream[-1]["finished"], stream[-1]
    assert stream[-1]["meta"].get("finish_reason") in ("length", "stop"), stream[-1]
    assert not any(m["finished"] for m in stream[:-1])


def test_http_generate_through_the_gateway_service(client_result: dict):
    http = client_result["http"]
    assert http["status"] == 200, http
    body = http["body"]
    assert body["text"], body
    reason = body["meta_info"]["finish_reason"]  # SGLang: {"type": "length", "length": 16}
    assert (reason.get("type") if isinstance(reason, dict) else reason) in ("length", "stop"), \
        body


def test_both_schedulers_found_through_the_headless_service(cluster: Cluster,
                                                            client_result: dict):
    loads = client_result["loads"]
    port = cluster.service_port("meshlm-scheduler")
    want = {f"{p.ip}:{port}" for p in cluster.pods_by_role("scheduler")}
    assert sorted(x["dp_rank"] for x in loads) == [0, 1], loads
    assert not any("error" in x for x in loads), loads
    assert {x["address"] for x in loads} == want, loads


def test_gateway_verifies_replicas_by_service_name(cluster: Cluster, client_result: dict):
    """Discovered replicas are dialled by pod IP and verified against the Service name their
    certificate carries (MESHLM_PEER_TLS_NAME meshlm-{role})."""
    gateway = cluster.pods_by_role("gateway")[0]
    events = []
    for line in cluster.logs(gateway.container).splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "dependency_added":
                events.append(event)
    with cluster.dump_on_failure():
        for role in ("tokenizer", "scheduler", "detokenizer"):
            port = cluster.service_port(f"meshlm-{role}")
            added = {e["address"]: e["server_name"] for e in events if e["role"] == role}
            want = {f"{p.ip}:{port}": f"meshlm-{role}" for p in cluster.pods_by_role(role)}
            assert added == want, (role, events)


def test_mesh_tls_refuses_a_wrong_peer_name(cluster: Cluster):
    """The tokenizer's own certificate, asking a scheduler pod by IP: accepted when it expects
    `meshlm-scheduler` (the pod's env), refused when it expects any other name."""
    tokenizer = cluster.pods_by_role("tokenizer")[0]
    scheduler = cluster.pods_by_role("scheduler")[1]
    address = f"{scheduler.ip}:{cluster.service_port('meshlm-scheduler')}"
    probe = ["python", "-m", "meshlm.health", "scheduler", "--address", address]
    with cluster.dump_on_failure():
        right = docker("exec", tokenizer.container, *probe, check=False, timeout=60)
        assert right.returncode == 0, right.stdout + right.stderr
        wrong = docker("exec", "-e", "MESHLM_PEER_TLS_NAME=wrong-{role}", tokenizer.container,
                       *probe, check=False, timeout=60)
        # 1: not SERVING; the TLS handshake fails, so the channel never comes up
        assert wrong.returncode == 1, wrong.stdout + wrong.stderr
        assert "UNAVAILABLE" in wrong.stderr, wrong.stderr
