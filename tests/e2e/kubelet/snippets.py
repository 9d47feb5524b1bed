"""Python run inside the image by cluster.py and test_k8s_pods.py: the Secret maker, kubelet's
probes from outside the pods, and the end-to-end client."""

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
