"""Container test support: a real Docker engine, the real image built from deploy/Dockerfile.

On a machine without Docker these tests skip with a message saying how to get one; CI sets
MESHLM_REQUIRE_CONTAINERS=1 (after `.ci/containers.sh`), where a missing engine fails instead.
Images a machine without registry access must find locally are named by variables:
MESHLM_TEST_BASE_IMAGE (the Dockerfile's BASE_IMAGE), MESHLM_TEST_REDIS_IMAGE, and
MESHLM_TEST_WHEELS (a folder of wheels offered to pip in the build, e.g. the CPU torch wheel).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOW = ("container tests need a Docker engine and Compose v2; as root run "
       "`. .ci/containers.sh && containers_up` (installs docker.io, starts dockerd, the Compose "
       "plugin and local base images), then `make test`")
REDIS_IMAGE = os.environ.get("MESHLM_TEST_REDIS_IMAGE", "redis:7-alpine")


def require_docker() -> None:
    """Skip (or, with MESHLM_REQUIRE_CONTAINERS=1, fail) unless docker and compose answer."""
    problem = None
    if shutil.which("docker") is None:
        problem = "no docker CLI"
    else:
        for args in (["info"], ["compose", "version"]):
            r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                problem = f"`docker {' '.join(args)}` failed: {r.stderr.strip()[:200]}"
                break
    if problem is None:
        return
    if os.environ.get("MESHLM_REQUIRE_CONTAINERS") == "1":
        pytest.fail(f"{problem}; {HOW}")
    pytest.skip(f"{problem}; {HOW}")


def docker(*args: str, check: bool = True, timeout: float = 600,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} -> {r.returncode}\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-3000:]}")
    return r


def _context(directory: Path) -> None:
    """What `docker build .` at the repository root sends, minus ignored and generated files,
    plus MESHLM_TEST_WHEELS in deploy/wheels/."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    keep = [p for p in listed if p.split("/")[0] in ("deploy", "proto", "services")
            or p in ("pyproject.toml", "README.md", ".dockerignore")]
    with tarfile.open(directory / "ctx.tar", "w") as tar:
        for path in keep:
            if (ROOT / path).is_file():
                tar.add(ROOT / path, arcname=path)
    with tarfile.open(directory / "ctx.tar") as tar:
        tar.extractall(directory / "ctx", filter="data")
    wheels = os.environ.get("MESHLM_TEST_WHEELS")
    for wheel in Path(wheels).glob("*.whl") if wheels else ():
        target = directory / "ctx" / "deploy" / "wheels" / wheel.name
        try:
            os.link(wheel, target)
        except OSError:
            shutil.copy(wheel, target)


def build_image(tag: str, workdir: Path) -> dict[str, float]:
    """Build deploy/Dockerfile as `tag`; returns {"seconds": build time, "bytes": size}."""
    _context(workdir)
    args = ["build", "-q", "-f", "deploy/Dockerfile", "-t", tag]
    if base := os.environ.get("MESHLM_TEST_BASE_IMAGE"):
        args += ["--build-arg", f"BASE_IMAGE={base}"]
    if os.environ.get("MESHLM_TEST_WHEELS"):
        args += ["--build-arg", "TORCH_CPU_INDEX="]  # the local CPU wheel, no other index
    start = time.monotonic()
    docker(*args, str(workdir / "ctx"), timeout=1500)
    seconds = time.monotonic() - start
    size = json.loads(docker("image", "inspect", tag).stdout)[0]["Size"]
    return {"seconds": seconds, "bytes": float(size)}
