"""Kubelet, kube-dns and the Secret store played with plain Docker, for test_k8s_pods.py: runs
the pods that rendered manifests describe as containers on one network (see that file's docstring
for what is and is not emulated)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import random
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from containers import docker

KUBECTL = shutil.which("kubectl")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
NAMESPACE = "meshlm-e2e"
CLUSTER_DOMAIN = "cluster.local"
# The manifests' image repositories; the test maps them onto local images (no registry here).
MESHLM_REPO = "meshlm/meshlm"
REDIS_REPO = "redis"
# `kubectl scale deployment meshlm-scheduler --replicas 2`: two replicas behind the headless name.
SCALE = {"meshlm-scheduler": 2}
STARTUP_DEADLINE = 180.0  # cap on the startupProbe's own budget (periodSeconds x failureThreshold)
READY_DEADLINE = 60.0
PROBE_PERIOD_CAP = 2.0  # run probes at most this far apart (kubelet: periodSeconds)
RUN_LABEL = "dev.meshlm.e2e-k8s-run"
LOG_TAIL = 60


# --- rendering ------------------------------------------------------------------------------------

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


# --- the plan: manifests -> docker run ------------------------------------------------------------

POD_KEYS = {"containers", "volumes", "securityContext", "automountServiceAccountToken",
            "terminationGracePeriodSeconds", "serviceAccountName", "restartPolicy",
            "enableServiceLinks"}
CONTAINER_KEYS = {"name", "image", "command", "args", "env", "envFrom", "ports", "startupProbe",
                  "readinessProbe", "livenessProbe", "resources", "securityContext",
                  "volumeMounts", "workingDir"}


@dataclass
class SecretMount:
    volume: str  # the Docker volume holding this pod's copy of the Secret
    mount_path: str
    secret: str
    mode: int
    gid: int
    items: list[dict] | None


@dataclass
class Pod:
    workload: str  # Deployment / Job name
    name: str  # pod name (hostname, metadata.name)
    container: str  # Docker container name
    ip: str | None
    labels: dict[str, str]
    spec: dict  # the pod template's spec
    main: dict  # its (only) container
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)  # entrypoint + args, expanded
    run_args: list[str] = field(default_factory=list)  # docker run options
    image: str = ""
    secret_mounts: list[SecretMount] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)

    @property
    def role(self) -> str:
        return self.labels.get("app.kubernetes.io/component", "")


class Cluster:
    """One run: a network, volumes and containers, all named `mk8s-<run>-...` and labelled."""

    def __init__(self, objs: list[dict], images: dict[str, str]) -> None:
        self.objs = objs
        self.images = images
        self.run = secrets.token_hex(3)
        self.prefix = f"mk8s-{self.run}"
        self.network = f"{self.prefix}-net"
        self.containers: list[str] = []
        self.volumes: list[str] = []
        self.network_made = False
        self.pods: list[Pod] = []
        self.job: Pod | None = None
        self.service_ip: dict[str, str] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.timings: dict[str, float] = {}
        self.readiness: dict[str, list] = {}
        self.job_volume = ""  # the init Job's emptyDir, kept as a Docker volume
        self._workdirs: dict[str, str] = {}
        self._lock = threading.Lock()

    # -- lookups --

    def config_maps(self) -> dict[str, dict[str, str]]:
        return {o["metadata"]["name"]: o.get("data") or {} for o in of_kind(self.objs, "ConfigMap")}

    def services(self) -> list[dict]:
        return of_kind(self.objs, "Service")

    def service_port(self, name: str, port_name: str | None = None) -> int:
        """A Service's port (its only one, or the one named so)."""
        svc = next(s for s in self.services() if s["metadata"]["name"] == name)
        ports = [p for p in svc["spec"]["ports"] if port_name in (None, p.get("name"))]
        assert len(ports) == 1, (name, port_name, svc["spec"]["ports"])
        return ports[0]["port"]

    def pods_by_role(self, role: str) -> list[Pod]:
        return [p for p in self.pods if p.role == role]

    def label_args(self, **extra: str) -> list[str]:
        out = ["--label", f"{RUN_LABEL}={self.run}"]
        for k, v in extra.items():
            out += ["--label", f"{k}={v}"]
        return out

    # -- network --

    def make_network(self) -> None:
        taken: list[ipaddress.IPv4Network] = []
        ids = docker("network", "ls", "-q").stdout.split()
        if ids:
            for net in json.loads(docker("network", "inspect", *ids).stdout):
                for cfg in (net.get("IPAM") or {}).get("Config") or []:
                    with contextlib.suppress(ValueError, KeyError):
                        taken.append(ipaddress.ip_network(cfg["Subnet"], strict=False))
        rng = random.Random()
        for _ in range(20):
            subnet = ipaddress.ip_network(f"10.{rng.randint(200, 249)}.{rng.randint(0, 255)}.0/24")
            if any(subnet.overlaps(t) for t in taken if t.version == 4):
                continue
            # Pods get fixed addresses below .128 (kubelet knows status.podIP before the
            # container starts); clients get whatever Docker hands out from the upper half.
            upper = list(subnet.subnets(new_prefix=25))[1]
            r = docker("network", "create", "--driver", "bridge", "--subnet", str(subnet),
                       "--ip-range", str(upper), *self.label_args(), self.network, check=False)
            if r.returncode == 0:
                self.subnet = subnet
                self.network_made = True
                return
            if "overlap" not in r.stderr.lower():
                raise AssertionError(f"docker network create failed: {r.stderr}")
        raise AssertionError("no free /24 for the test network in 10.200-249.x.0")

    # -- planning --

    def plan(self) -> None:
        """Pods for every Deployment and the init Job, and their `docker run` options."""
        assert self.subnet is not None
        hosts = iter(self.subnet.hosts())
        for _ in range(9):  # .1 is the bridge; pods from .10
            next(hosts)
        for d in of_kind(self.objs, "Deployment"):
            name = d["metadata"]["name"]
            replicas = SCALE.get(name, d["spec"].get("replicas", 1))
            labels = d["spec"]["template"]["metadata"].get("labels") or {}
            assert selector_matches(d["spec"]["selector"]["matchLabels"], labels), name
            for i in range(replicas):
                pod_name = f"{name}-{self.run}-{i}"
                self.pods.append(self._pod(name, pod_name, str(next(hosts)),
                                           d["spec"]["template"]))
        jobs = of_kind(self.objs, "Job")
        assert [j["metadata"]["name"] for j in jobs] == ["meshlm-init"], "one init Job expected"
        self.job = self._pod("meshlm-init", f"meshlm-init-{self.run}", None,
                             jobs[0]["spec"]["template"])
        self._wire_services()
        for pod in [*self.pods, self.job]:
            self._finish(pod)

    def _pod(self, workload: str, pod_name: str, ip: str | None, template: dict) -> Pod:
        spec = template["spec"]
        unknown = set(spec) - POD_KEYS
        assert not unknown, f"{workload}: pod fields this test cannot play yet: {unknown}"
        assert len(spec["containers"]) == 1 and not spec.get("initContainers"), workload
        main = spec["containers"][0]
        unknown = set(main) - CONTAINER_KEYS
        assert not unknown, f"{workload}: container fields this test cannot play yet: {unknown}"
        return Pod(workload=workload, name=pod_name, container=f"{self.prefix}-{pod_name}",
                   ip=ip, labels=template["metadata"].get("labels") or {}, spec=spec, main=main)

    def _wire_services(self) -> None:
        """Aliases (kube-dns) and the stand-in cluster IPs of ClusterIP Services."""
        for svc in self.services():
            name = svc["metadata"]["name"]
            spec = svc["spec"]
            selected = [p for p in self.pods if selector_matches(spec["selector"], p.labels)]
            assert selected, f"Service {name} selects no pod"
            for port in spec["ports"]:
                target = port.get("targetPort", port["port"])
                for pod in selected:
                    number = next((p["containerPort"] for p in pod.main.get("ports") or []
                                   if target in (p["containerPort"], p.get("name"))), None)
                    assert number is not None, \
                        f"Service {name} port {port}: pod {pod.name} has no port {target!r}"
                    # Docker aliases cannot remap ports: a ClusterIP Service port must equal
                    # its target here (a headless one is dialled on the pod's port anyway).
                    assert number == port["port"], \
                        f"Service {name}: port {port['port']} -> container port {number}"
            fqdn = f"{name}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
            for pod in selected:
                pod.aliases.append(fqdn)
            if spec.get("clusterIP") != "None":
                assert len(selected) == 1, f"ClusterIP Service {name}: one pod expected"
                # kube-proxy would forward the cluster IP to this one pod: use its address.
                self.service_ip[name] = selected[0].ip or ""

    def _service_links(self) -> dict[str, str]:
        """The variables kubelet injects for each ClusterIP Service of the namespace
        (enableServiceLinks defaults to true); headless Services get none."""
        env: dict[str, str] = {}
        for svc in self.services():
            name = svc["metadata"]["name"]
            if name not in self.service_ip:
                continue
            ip = self.service_ip[name]
            base = name.upper().replace("-", "_")
            ports = svc["spec"]["ports"]
            env[f"{base}_SERVICE_HOST"] = ip
            env[f"{base}_SERVICE_PORT"] = str(ports[0]["port"])
            for p in ports:
                if p.get("name"):
                    env[f"{base}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = \
                        str(p["port"])
            proto0 = ports[0].get("protocol", "TCP").lower()
            env[f"{base}_PORT"] = f"{proto0}://{ip}:{ports[0]['port']}"
            for p in ports:
                proto = p.get("protocol", "TCP")
                key = f"{base}_PORT_{p['port']}_{proto}"
                env[key] = f"{proto.lower()}://{ip}:{p['port']}"
                env[f"{key}_PROTO"] = proto.lower()
                env[f"{key}_PORT"] = str(p["port"])
                env[f"{key}_ADDR"] = ip
        return env

    def _field(self, pod: Pod, path: str) -> str:
        values = {"metadata.namespace": NAMESPACE, "metadata.name": pod.name,
                  "status.podIP": pod.ip, "status.podIPs": pod.ip}
        assert path in values, f"{pod.workload}: downward API field {path} not played here"
        value = values[path]
        assert value is not None, f"{pod.workload}: {path} asked of a pod without network"
        return value

    def _finish(self, pod: Pod) -> None:
        c, spec = pod.main, pod.spec
        # Environment, in kubelet's order: envFrom, then env (each value expanded against
        # what is defined so far and the Service links), then Service links not yet defined.
        links = self._service_links() if spec.get("enableServiceLinks", True) else {}
        env: dict[str, str] = {}
        maps = self.config_maps()
        for source in c.get("envFrom") or []:
            assert set(source) <= {"configMapRef", "prefix"}, f"{pod.workload}: {source}"
            ref = source["configMapRef"]["name"]
            assert ref in maps, f"{pod.workload}: envFrom ConfigMap {ref} is not in the manifests"
            for k, v in maps[ref].items():
                env[source.get("prefix", "") + k] = str(v)
        for item in c.get("env") or []:
            if "value" in item:
                env[item["name"]] = expand(str(item["value"]), {**links, **env})
            elif "fieldRef" in (item.get("valueFrom") or {}):
                env[item["name"]] = self._field(pod, item["valueFrom"]["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in (item.get("valueFrom") or {}):
                ref = item["valueFrom"]["configMapKeyRef"]
                env[item["name"]] = maps[ref["name"]][ref["key"]]
            else:
                raise AssertionError(f"{pod.workload}: env source not played here: {item}")
        for k, v in links.items():
            env.setdefault(k, v)
        pod.env = env

        # Image: the manifests' names, mapped onto the local images.
        repo, _ = image_repo(c["image"])
        assert repo in self.images, f"{pod.workload}: image {c['image']} is not one this " \
                                    f"test maps ({sorted(self.images)})"
        pod.image = self.images[repo]

        # Security context: the container's fields over the pod's.
        psc, csc = spec.get("securityContext") or {}, c.get("securityContext") or {}
        user = csc.get("runAsUser", psc.get("runAsUser"))
        group = csc.get("runAsGroup", psc.get("runAsGroup"))
        assert user is not None and group is not None, f"{pod.workload}: runAsUser/runAsGroup"
        if csc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            assert user != 0, f"{pod.workload}: runAsNonRoot with runAsUser 0 (kubelet refuses)"
        fs_group = psc.get("fsGroup")
        args = ["--user", f"{user}:{group}"]
        for g in [*(psc.get("supplementalGroups") or []), *([fs_group] if fs_group else [])]:
            args += ["--group-add", str(g)]
        if csc.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        caps = csc.get("capabilities") or {}
        for cap in caps.get("drop") or []:
            args += ["--cap-drop", cap]
        for cap in caps.get("add") or []:
            args += ["--cap-add", cap]
        if csc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges:true"]
        assert not csc.get("privileged"), f"{pod.workload}: privileged"
        seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        # RuntimeDefault is Docker's default profile; Unconfined would be spelt out.
        assert seccomp in (None, "RuntimeDefault"), f"{pod.workload}: seccomp {seccomp}"

        # Volumes: emptyDir -> tmpfs, Secret -> a per-pod Docker volume filled below.
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for m in c.get("volumeMounts") or []:
            assert set(m) <= {"name", "mountPath", "readOnly"}, f"{pod.workload}: {m}"
            vol = volumes[m["name"]]
            if "emptyDir" in vol:
                if pod is self.job:
                    # The Job's emptyDir holds its output (the certificates): a Docker volume
                    # instead of a tmpfs, so the Secrets can be made from it after it exits.
                    name = f"{self.prefix}-{pod.name}-{m['name']}"
                    self.volumes.append(name)
                    self.job_volume = f"{name}:{m['mountPath']}"
                    args += ["-v", self.job_volume]
                    continue
                opts = ["rw", "exec", "mode=1777"]
                if limit := (vol["emptyDir"] or {}).get("sizeLimit"):
                    opts.append(f"size={memory_bytes(limit)}")
                args += ["--tmpfs", f"{m['mountPath']}:{','.join(opts)}"]
            elif "secret" in vol:
                sec = vol["secret"]
                name = f"{self.prefix}-{pod.name}-{m['name']}"
                self.volumes.append(name)
                pod.secret_mounts.append(SecretMount(
                    volume=name, mount_path=m["mountPath"], secret=sec["secretName"],
                    mode=sec.get("defaultMode", 0o644), gid=fs_group or 0,
                    items=sec.get("items")))
                args += ["-v", f"{name}:{m['mountPath']}:ro"]  # Secret volumes are read-only
            else:
                raise AssertionError(f"{pod.workload}: volume type not played here: {vol}")

        limits = (c.get("resources") or {}).get("limits") or {}
        if "memory" in limits:  # no swap, as on a kubelet node
            mem = str(memory_bytes(limits["memory"]))
            args += ["--memory", mem, "--memory-swap", mem]
        if "terminationGracePeriodSeconds" in spec:
            args += ["--stop-timeout", str(spec["terminationGracePeriodSeconds"])]
        if "workingDir" in c:
            args += ["-w", c["workingDir"]]
        elif image_repo(c["image"])[0] == REDIS_REPO and not self._workdir(pod.image):
            # The official redis image's WORKDIR is /data (here the emptyDir); the local
            # stand-in image has none, so give it the one the real image would.
            args += ["-w", "/data"]

        # command/args: command replaces the image's ENTRYPOINT (and drops its CMD), args its CMD.
        command = [expand(str(a), env) for a in c.get("command") or []]
        cargs = [expand(str(a), env) for a in c.get("args") or []]
        if command:
            args += ["--entrypoint", command[0]]
            pod.argv = [*command[1:], *cargs]
        else:
            pod.argv = cargs
        pod.run_args = args

    def _workdir(self, image: str) -> str:
        if image not in self._workdirs:
            self._workdirs[image] = json.loads(docker("image", "inspect", image).stdout)[0][
                "Config"].get("WorkingDir") or ""
        return self._workdirs[image]

    def dns_args(self) -> list[str]:
        """kubelet's resolv.conf for dnsPolicy ClusterFirst."""
        out = []
        for domain in (f"{NAMESPACE}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}",
                       CLUSTER_DOMAIN):
            out += ["--dns-search", domain]
        return [*out, "--dns-option", "ndots:5"]

    def env_args(self, env: dict[str, str]) -> list[str]:
        return [a for k, v in env.items() for a in ("-e", f"{k}={v}")]

    # -- running --

    def run_job(self) -> str:
        """The init Job's pod, minus `--k8s-secrets PREFIX`; returns PREFIX."""
        job = self.job
        assert job is not None
        argv = list(job.argv)
        assert "--k8s-secrets" in argv, "the init Job no longer stores Secrets (--k8s-secrets)"
        i = argv.index("--k8s-secrets")
        prefix = argv[i + 1]
        # The API upload is the only part of the Job not exercised: there is no API server.
        del argv[i:i + 2]
        self.containers.append(job.container)
        r = docker("run", "--pull", "never", "--name", job.container, "--hostname", job.name,
                   "--network", "none", *self.label_args(pod=job.name), *job.run_args,
                   *self.env_args(job.env), job.image, *argv, check=False, timeout=180)
        print(f"\n[{job.workload}] exit {r.returncode}\n{r.stdout}{r.stderr}")
        assert r.returncode == 0, f"the init Job failed ({r.returncode})"
        return prefix

    def make_secrets(self, prefix: str) -> dict[str, dict]:
        """Run the Job's CLI (its full args, --k8s-secrets included) again over its output, with
        the API client replaced by a recorder, and write what it would upload into each pod's
        Secret volumes. Returns {secret name: {"type", "keys", "namespace"}}."""
        job = self.job
        assert job is not None
        assert job.argv[:2] == ["-m", "meshlm.launch.certs"] and \
            job.run_args[job.run_args.index("--entrypoint") + 1] == "python", \
            f"the init Job's command changed: {job.argv}"
        mounts = [m for p in self.pods for m in p.secret_mounts]
        spec = {"argv": job.argv[2:], "mounts": [
            {"path": f"/out/{i}", "secret": m.secret, "mode": m.mode, "gid": m.gid,
             "items": m.items} for i, m in enumerate(mounts)]}
        vols = [a for i, m in enumerate(mounts) for a in ("-v", f"{m.volume}:/out/{i}")]
        name = f"{self.prefix}-secrets"
        self.containers.append(name)
        r = docker("run", "--pull", "never", "--rm", "--name", name, "--network", "none",
                   "--user", "0:0",
                   *self.label_args(), "-v", self.job_volume, *vols, *self.env_args(job.env),
                   "--entrypoint", "python", job.image, "-c", SECRETS_SNIPPET,
                   json.dumps(spec), check=False, timeout=120)
        print(r.stdout, r.stderr)
        assert r.returncode == 0, f"making the Secrets failed:\n{r.stdout}\n{r.stderr}"
        line = next(x for x in r.stdout.splitlines() if x.startswith("SECRETS "))
        stored = json.loads(line[len("SECRETS "):])
        assert all(s["namespace"] == NAMESPACE for s in stored.values()), stored
        assert all(name.startswith(f"{prefix}-") for name in stored), (prefix, stored)
        return stored

    def start_pods(self) -> None:
        order = sorted(self.pods, key=lambda p: p.role != "redis")  # redis first, as listed
        for pod in order:
            aliases = [a for alias in pod.aliases for a in ("--network-alias", alias)]
            self.containers.append(pod.container)
            docker("run", "--pull", "never", "-d", "--name", pod.container, "--hostname", pod.name,
                   "--network", self.network, "--ip", pod.ip or "", *aliases, *self.dns_args(),
                   *self.label_args(pod=pod.name, **pod.labels), *pod.run_args,
                   *self.env_args(pod.env), pod.image, *pod.argv, timeout=120)

    def state(self, pod: Pod) -> dict:
        return json.loads(docker("inspect", pod.container).stdout)[0]["State"]

    def assert_running(self, pod: Pod) -> None:
        state = self.state(pod)
        assert state["Running"] and not state["Restarting"], \
            f"pod {pod.name} is not running: {state['Status']} exit {state['ExitCode']}"

    def startup_probes(self, deadline: float) -> dict[str, float]:
        """Every pod's startup probe at once; the first failure stops the others."""
        stop = threading.Event()
        with ThreadPoolExecutor(max_workers=len(self.pods)) as pool:
            futures = {pool.submit(self.startup_probe, p, deadline, stop): p for p in self.pods}
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                stop.set()
                raise failed[0].exception()  # type: ignore[misc]
            return {futures[f].name: f.result() for f in futures}

    def startup_probe(self, pod: Pod, deadline: float, stop: threading.Event) -> float:
        """The startupProbe's exec command inside the pod until it exits 0; returns seconds."""
        probe = pod.main.get("startupProbe")
        start = time.monotonic()
        if probe is None:
            return 0.0
        assert set(probe) - {"periodSeconds", "timeoutSeconds", "failureThreshold",
                             "initialDelaySeconds", "successThreshold"} == {"exec"}, probe
        period = min(probe.get("periodSeconds", 10), PROBE_PERIOD_CAP)
        budget = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
        until = min(deadline, start + budget)
        last = ""
        while not stop.is_set():
            self.assert_running(pod)
            try:
                # kubelet's exec timeout, plus `docker exec` and a loaded 2-core machine
                r = docker("exec", pod.container, *probe["exec"]["command"], check=False,
                           timeout=probe.get("timeoutSeconds", 1) + 10)
                if r.returncode == 0:
                    return time.monotonic() - start
                last = (r.stdout + r.stderr).strip()[-300:]
            except subprocess.TimeoutExpired:
                last = "timed out"
            if time.monotonic() > until:
                raise AssertionError(f"startupProbe of {pod.name} never passed: {last}")
            time.sleep(period)
        raise AssertionError(f"startupProbe of {pod.name}: stopped, another pod failed")

    def kubelet_checks(self) -> list[dict]:
        """Readiness and liveness probes of every pod, as kubelet runs them from outside."""
        checks: dict[tuple, dict] = {}
        for pod in self.pods:
            for kind in ("readinessProbe", "livenessProbe"):
                probe = pod.main.get(kind)
                if probe is None:
                    continue
                if "grpc" in probe:
                    port = probe["grpc"]["port"]
                    check = {"kind": "grpc", "role": pod.role, "address": f"{pod.ip}:{port}",
                             "service": probe["grpc"].get("service", ""),
                             "timeout": probe.get("timeoutSeconds", 1)}
                elif "tcpSocket" in probe:
                    port = probe["tcpSocket"]["port"]
                    number = next((p["containerPort"] for p in pod.main.get("ports") or []
                                   if port in (p["containerPort"], p.get("name"))), None)
                    assert number is not None, f"{pod.name}: {kind} port {port!r} not declared"
                    check = {"kind": "tcp", "address": f"{pod.ip}:{number}",
                             "timeout": probe.get("timeoutSeconds", 1)}
                else:
                    raise AssertionError(f"{pod.name}: {kind} handler not played here: {probe}")
                key = tuple(sorted(check.items()))
                checks.setdefault(key, {**check, "names": []})["names"].append(
                    f"{pod.name} {kind}")
        return list(checks.values())

    def client(self, snippet: str, *argv: str, timeout: float = 180,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`python -c snippet` in a short-lived pod of the namespace (same image, same DNS)."""
        meshlm = self.images[MESHLM_REPO]
        with self._lock:
            name = f"{self.prefix}-client-{len(self.containers)}"
            self.containers.append(name)
        return docker("run", "--pull", "never", "--rm", "--name", name, "--network", self.network,
                      *self.dns_args(), *self.label_args(), *self.env_args(env or {}),
                      "--entrypoint", "python", meshlm, "-c", snippet, *argv,
                      check=False, timeout=timeout)

    def wait_ready(self) -> dict[str, list]:
        checks = self.kubelet_checks()
        deadline = time.monotonic() + READY_DEADLINE
        while True:
            for pod in self.pods:
                self.assert_running(pod)
            r = self.client(PROBE_SNIPPET, json.dumps(checks), timeout=120)
            assert r.returncode == 0, f"probe client failed:\n{r.stdout}\n{r.stderr}"
            results = json.loads(r.stdout.strip().splitlines()[-1])
            failing = {n: v for n, v in results.items() if v[0] != 0}
            if not failing:
                return results
            if time.monotonic() > deadline:
                raise AssertionError(f"readiness/liveness probes failing: {failing}")
            time.sleep(1.0)

    def logs(self, container: str, tail: int | None = None) -> str:
        args = ["logs", *(["--tail", str(tail)] if tail else []), container]
        r = docker(*args, check=False)
        return r.stdout + r.stderr

    def dump(self) -> None:
        for name in self.containers:
            if docker("inspect", name, check=False).returncode != 0:
                continue
            print(f"\n----- {name} (last {LOG_TAIL} lines) -----")
            print(self.logs(name, LOG_TAIL))

    @contextlib.contextmanager
    def dump_on_failure(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.dump()
            raise

    def cleanup(self) -> None:
        labelled = docker("ps", "-aq", "--filter", f"label={RUN_LABEL}={self.run}",
                          check=False).stdout.split()
        for name in [*self.containers, *labelled]:
            docker("rm", "-f", "-v", name, check=False)
        labelled = docker("volume", "ls", "-q", "--filter", f"label={RUN_LABEL}={self.run}",
                          check=False).stdout.split()
        for vol in dict.fromkeys([*self.volumes, *labelled]):
            docker("volume", "rm", "-f", vol, check=False)
        if self.network_made:
            docker("network", "rm", self.network, check=False)


# Runs as root in the image (a helper, not a pod): the init Job's CLI with its own args, its
# Kubernetes client swapped for a recorder, then kubelet's part: each pod's Secret volume gets
# the Secret's keys (or its `items`), owned by root:fsGroup with defaultMode.
SECRETS_SNIPPET = r"""
import json, os, sys
from pathlib import Path
import meshlm.launch.certs as certs

spec = json.loads(sys.argv[1])
stored = {}

class Recorder:
    def __init__(self, namespace=""):
        self.namespace = namespace
    def create(self, name, data, kind="Opaque"):
        stored[name] = {"namespace": self.namespace, "type": kind, "data": dict(data)}
        return True

certs.KubeSecrets = Recorder
certs.cli.main(args=spec["argv"], prog_name="meshlm-certs", standalone_mode=False)
for m in spec["mounts"]:
    secret = stored.get(m["secret"])
    if secret is None:
        continue  # the test reports it
    items = m["items"] or [{"key": k, "path": k} for k in secret["data"]]
    for item in items:
        target = Path(m["path"]) / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(secret["data"][item["key"]])
        os.chown(target, 0, m["gid"])
        os.chmod(target, item.get("mode", m["mode"]))
print("SECRETS " + json.dumps({n: {"namespace": s["namespace"], "type": s["type"],
                                   "keys": sorted(s["data"])} for n, s in stored.items()}))
"""

# kubelet's readiness/liveness handlers, run from outside the pods: gRPC health Check (what
# `grpc: {port}` does: plaintext, service "" unless set) with the image's probe command, and
# TCP connects. Prints {check: [exit code, output]}.
PROBE_SNIPPET = r"""
import json, socket, subprocess, sys
out = {}
for c in json.loads(sys.argv[1]):
    if c["kind"] == "grpc":
        cmd = [sys.executable, "-m", "meshlm.health", c["role"], "--plaintext",
               "--address", c["address"], "--service", c["service"],
               "--timeout", str(c["timeout"])]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=c["timeout"] + 30)
            result = [r.returncode, (r.stdout + r.stderr).strip()[-300:]]
        except subprocess.TimeoutExpired:
            result = [124, "timed out"]
    else:
        host, port = c["address"].rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=c["timeout"]).close()
            result = [0, "connected"]
        except OSError as e:
            result = [1, repr(e)]
    for name in c["names"]:
        out[name] = result
print(json.dumps(out))
"""

# The end-to-end client, a pod in the namespace: everything through the gateway Service's name.
CLIENT_SNIPPET = r"""
import json, os, sys, time, urllib.request
import grpc
from sglang.runtime.v1 import sglang_pb2 as pb, sglang_pb2_grpc as pbg

out = {}
with grpc.insecure_channel(os.environ["GATEWAY_GRPC"]) as ch:
    stub = pbg.SglangServiceStub(ch)
    req = pb.TextGenerateRequest(
        text="The capital of France is", stream=True,
        # 200 tokens (~1 s): long enough that the gateway cannot fold them all into one
        # message however slowly this client reads
        sampling_params=pb.SamplingParams(max_new_tokens=200, ignore_eos=True, temperature=0.0))
    out["stream"] = [{"text": m.text, "finished": m.finished, "meta": dict(m.meta_info)}
                     for m in stub.TextGenerate(req, timeout=120)]
    want = int(os.environ["SCHEDULERS"])
    deadline = time.monotonic() + 60
    while True:  # discovery re-resolves the headless name every second
        loads = json.loads(stub.GetLoad(pb.GetLoadRequest(), timeout=30).json_info)
        if (len(loads) >= want and not any("error" in x for x in loads)) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out["loads"] = loads
body = json.dumps({"text": "The capital of France is",
                   "sampling_params": {"max_new_tokens": 16, "temperature": 0}}).encode()
http = urllib.request.Request(os.environ["GATEWAY_HTTP"] + "/generate", data=body,
                              headers={"Content-Type": "application/json"}, method="POST")
with urllib.request.urlopen(http, timeout=120) as r:
    out["http"] = {"status": r.status, "body": json.loads(r.read())}
print("RESULT " + json.dumps(out))
"""


# --- fixtures -------------------------------------------------------------------------------------
