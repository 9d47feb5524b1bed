"""The plan: the pods that the rendered manifests describe, each with its environment, image,
security context, volumes and command turned into `docker run` options. Nothing runs here except
`docker image inspect` (cluster.py runs the plan)."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field

from containers import docker

from kubelet.manifests import (
    CLUSTER_DOMAIN,
    NAMESPACE,
    REDIS_REPO,
    expand,
    image_repo,
    memory_bytes,
    of_kind,
    selector_matches,
)

# `kubectl scale deployment meshlm-scheduler --replicas 2`: two replicas behind the headless name.
SCALE = {"meshlm-scheduler": 2}

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


class ClusterPlan:
    """The pods of one run (named `mk8s-<run>-...`), planned once the network's subnet is
    known."""

    def __init__(self, objs: list[dict], images: dict[str, str], run: str) -> None:
        self.objs = objs
        self.images = images
        self.run = run
        self.prefix = f"mk8s-{run}"
        self.volumes: list[str] = []
        self.pods: list[Pod] = []
        self.job: Pod | None = None
        self.service_ip: dict[str, str] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.job_volume = ""  # the init Job's emptyDir, kept as a Docker volume
        self._workdirs: dict[str, str] = {}

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
