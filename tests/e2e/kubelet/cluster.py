"""A Cluster runs its plan with Docker: the network, the init Job and its Secrets, the pods, then
kubelet's probes (startup in the pod, readiness and liveness from outside), clients in the
namespace, logs, and a cleanup of everything labelled with the run."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import random
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from containers import docker

from kubelet.manifests import CLUSTER_DOMAIN, MESHLM_REPO, NAMESPACE
from kubelet.plan import ClusterPlan, Pod
from kubelet.snippets import PROBE_SNIPPET, SECRETS_SNIPPET

STARTUP_DEADLINE = 180.0  # cap on the startupProbe's own budget (periodSeconds x failureThreshold)
READY_DEADLINE = 60.0
PROBE_PERIOD_CAP = 2.0  # run probes at most this far apart (kubelet: periodSeconds)
RUN_LABEL = "dev.meshlm.e2e-k8s-run"
LOG_TAIL = 60


class Cluster(ClusterPlan):
    """One run: a network, volumes and containers, all named `mk8s-<run>-...` and labelled."""

    def __init__(self, objs: list[dict], images: dict[str, str]) -> None:
        super().__init__(objs, images, secrets.token_hex(3))
        self.network = f"{self.prefix}-net"
        self.containers: list[str] = []
        self.network_made = False
        self.timings: dict[str, float] = {}
        self.readiness: dict[str, list] = {}
        self._lock = threading.Lock()

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
