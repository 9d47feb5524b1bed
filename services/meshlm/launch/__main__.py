"""python -m meshlm.launch (`make run`, the `meshlm` script): the whole mesh in the foreground.

Starts redis (unless --redis-url), the tokenizer, scheduler and detokenizer, then the gateway;
prints where to reach it; on Ctrl-C or SIGTERM stops everything and exits 0. A service that
exits on its own is restarted on the same address with backoff while the others serve on
(supervisor.py); a crash loop stops everything, names the service with its last log lines, and
exits 1. Restarts are counted on --launcher-metrics-port.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from prometheus_client import start_http_server

from meshlm.common import config as cfg
from meshlm.common.logs import get_logger, setup_logging
from meshlm.common.metrics import LauncherMetrics
from meshlm.launch.mesh import API_KEY_ENV, Mesh, MeshOptions
from meshlm.launch.readiness import MeshStartError
from meshlm.launch.supervisor import RestartPolicy, Supervisor

log = get_logger(__name__)


@dataclass
class LaunchConfig:
    """Run the whole meshlm mesh (redis, tokenizer, scheduler, detokenizer, gateway) locally."""

    model_path: str = cfg.field("", "checkpoint directory (HF layout); empty = embedded default")
    host: str = cfg.field("127.0.0.1", "address every service binds to")
    http_port: int = cfg.field(30000, "gateway HTTP port; 0 picks a free port")
    grpc_port: int = cfg.field(0, "gateway public gRPC port; 0 = HTTP port + 10000")
    redis_url: str = cfg.field("", "Redis for the gateways' registry; empty = start one")
    workdir: str = cfg.field(".meshlm", "certificates and logs/<service>.log go here")
    tls_cert: str = cfg.field("", "public TLS certificate (PEM) for the gateway; plaintext if "
                                  "empty")
    tls_key: str = cfg.field("", "public TLS private key (PEM)")
    dev_tls: bool = cfg.field(False, "public TLS with the generated dev certificate "
                                     "(<workdir>/certs/server.pem, CA ca.pem)")
    log_level: str = cfg.field("info", "debug | info | warning | error (every service)")
    echo_logs: bool = cfg.field(False, "also print every service's log lines here")
    startup_timeout: float = cfg.field(120.0, "seconds each start-up phase may take")
    api_key: tuple[str, ...] = cfg.field((), "the gateway's API keys (clients send "
                                             "'authorization: Bearer <key>'); none = open",
                                         secret=True)
    metrics_port: int = cfg.field(0, "Prometheus port of the gateway; the tokenizer, scheduler "
                                     "and detokenizer take the next three; 0 = none (the "
                                     "gateway's HTTP port serves /metrics anyway)")
    tokenizers: int = cfg.field(1, "tokenizer replicas")
    schedulers: int = cfg.field(1, "scheduler replicas (data-parallel engines; one per GPU)")
    detokenizers: int = cfg.field(1, "detokenizer replicas")
    gateways: int = cfg.field(1, "gateways; the first takes --http-port / --grpc-port, the "
                                 "others free ports (shown at start)")
    discover: bool = cfg.field(False, "backends announce themselves in Redis and the gateways "
                                      "find them there (--discover) instead of static lists")
    restart_backoff: float = cfg.field(0.5, "seconds before restarting a service that exited; "
                                            "doubles with each restart, at most 10 s")
    max_restarts: int = cfg.field(5, "restarts of one service allowed within --restart-window; "
                                     "one more exit stops the mesh (crash loop)")
    restart_window: float = cfg.field(60.0, "seconds over which restarts are counted")
    standby: bool = cfg.field(True, "keep a copy of each service started ahead, its code "
                                    "imported, for its next restart (seconds faster; about "
                                    "160 MiB of memory for a scheduler, 40 for the others)")
    launcher_metrics_port: int = cfg.field(0, "Prometheus port of the launcher itself "
                                              "(meshlm:service_restarts_total, "
                                              "meshlm:service_up); 0 = a free port, shown at "
                                              "start")


class _Stop(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM/SIGINT (a supervisor and `timeout` both signalling, a double
    # Ctrl-C) must not interrupt the shutdown the first one started.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop(signal.Signals(signum).name)


def run(config: LaunchConfig) -> int:
    """Start the mesh, wait for a signal or a dead service, stop. Returns the exit code."""
    setup_logging("launch", config.log_level)
    log.info("starting", config=cfg.as_dict(config))
    if bool(config.tls_cert) != bool(config.tls_key):
        log.error("bad_flags", reason="--tls-cert and --tls-key go together")
        return 2
    grpc_port = config.grpc_port or (config.http_port + 10000 if config.http_port else 0)
    mesh = Mesh(MeshOptions(
        workdir=Path(config.workdir), model_path=config.model_path, host=config.host,
        http_port=config.http_port, grpc_port=grpc_port, redis_url=config.redis_url,
        gateway_tls=config.dev_tls, tls_cert=config.tls_cert, tls_key=config.tls_key,
        log_level=config.log_level, echo_logs=config.echo_logs,
        startup_timeout=config.startup_timeout, api_keys=config.api_key,
        metrics_port=config.metrics_port or None,
        replicas={"tokenizer": config.tokenizers, "scheduler": config.schedulers,
                  "detokenizer": config.detokenizers, "gateway": config.gateways},
        discover=config.discover,
    ))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_stop)
    policy = RestartPolicy(backoff=config.restart_backoff, max_restarts=config.max_restarts,
                           window=config.restart_window)
    metrics = LauncherMetrics()
    supervisor: Supervisor | None = None
    metrics_server = None
    code = 0
    try:
        mesh.start()
        metrics_server, _ = start_http_server(config.launcher_metrics_port, addr=config.host,
                                              registry=metrics.registry)
        metrics_at = _http_address(config.host, metrics_server.server_port)
        supervisor = Supervisor(mesh, policy, metrics, standby=config.standby)
        log.info("supervising", metrics=metrics_at, backoff=policy.backoff,
                 max_restarts=policy.max_restarts, window=policy.window)
        print(banner(mesh, metrics_at), flush=True)
        while not (loop := supervisor.check()):
            time.sleep(0.2)
        print(loop.message(), file=sys.stderr, flush=True)
        code = 1
    except _Stop as e:
        log.info("shutdown_requested", signal=str(e))
    except MeshStartError as e:
        log.error("start_failed", error=str(e))
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # nor a signal during cleanup
            signal.signal(sig, signal.SIG_IGN)
        if supervisor is not None:
            supervisor.stop()
        mesh.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
    log.info("stopped", code=code)
    return code


def _http_address(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host.strip('[]')}]" \
        if ":" in host else host
    return f"http://{shown}:{port}/metrics"


def banner(mesh: Mesh, launcher_metrics: str = "") -> str:
    """What a person needs to start poking at the running mesh."""
    at = mesh.addresses
    tls = at.gateway_http.startswith("https")
    dev_ca = mesh.service("gateway").flags.get("tls-cert") == str(at.certs.server_cert)
    grpcurl = f"-cacert {at.certs.ca_cert}" if dev_ca else "-insecure" if tls else "-plaintext"
    curl = f"--cacert {at.certs.ca_cert} " if dev_ca else "-k " if tls else ""
    body = '{"text": "Hello, my name is", "sampling_params": {"max_new_tokens": 16}}'
    gateway = mesh.service("gateway")
    auth = "-H 'authorization: Bearer <key>' " if API_KEY_ENV in gateway.env else ""
    metrics = [f"  {'':13}{name:<12}http://{p.metrics_address}/metrics"
               for name, p in mesh.services.items() if p.flags.get("metrics-port", "0") != "0"]
    return "\n".join([
        "",
        "meshlm is ready",
        f"  HTTP         {at.gateway_http}",
        f"  gRPC         {at.gateway_grpc} ({'TLS' if tls else 'plaintext'})",
        *(f"  {role:<12} {', '.join(p.address for p in mesh.replicas(role))} (mTLS)"
          for role in ("tokenizer", "scheduler", "detokenizer")),
        *(f"  {p.name:<12} HTTP {p.http_address}, gRPC {p.grpc_address}"
          for p in mesh.replicas("gateway")[1:]),
        f"  redis        {at.redis_url}",
        f"  certs        {at.certs.directory}",
        f"  logs         {mesh.workdir / 'logs'}/<service>.log",
        f"  metrics      {at.gateway_http}/metrics",
        *metrics,
        *([f"  {'':13}{'launcher':<12}{launcher_metrics}"] if launcher_metrics else []),
        *(["  API keys     required (health, reflection and /metrics are open)"] if auth else []),
        "",
        "Try:",
        f"  grpcurl {grpcurl} {at.gateway_grpc} list",
        f"  curl -s {curl}{auth}{at.gateway_http}/generate -H 'content-type: application/json' \\",
        f"       -d '{body}'",
        "",
        "A service that exits is restarted. Ctrl-C stops everything.",
        "",
    ])


@cfg.command(LaunchConfig, "meshlm")
def cli(config: LaunchConfig) -> None:
    sys.exit(run(config))


def main() -> None:
    """Entry point of the `meshlm` console script."""
    cli()


if __name__ == "__main__":
    main()
