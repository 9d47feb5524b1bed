"""Kubelet, kube-dns and the Secret store played with plain Docker, for test_k8s_pods.py: runs
the pods that rendered manifests describe as containers on one network (see that file's docstring
for what is and is not emulated).

manifests.py renders deploy/k8s, plan.py turns its pods into `docker run` options, cluster.py
runs them and plays kubelet's probes, snippets.py holds the Python run inside the image."""
