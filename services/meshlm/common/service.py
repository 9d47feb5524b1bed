"""What every service shares: its base configuration and the process entry point."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from meshlm.common import config as cfg
from meshlm.common.logs import get_logger, setup_logging
from meshlm.common.tracing import setup_tracing, shutdown_tracing

log = get_logger(__name__)


@dataclass
class ServiceConfig:
    """Flags every mesh service takes (each also MESHLM_<NAME>)."""

    host: str = cfg.field("127.0.0.1", "address to bind the mesh gRPC port on")
    port: int = cfg.field(0, "mesh gRPC port (mutual TLS); 0 picks a free port")
    advertise_host: str = cfg.field("", "host other services use to reach this one "
                                        "(default: --host)")
    mesh_ca: str = cfg.field("", "CA certificate (PEM) that signs every mesh service")
    mesh_cert: str = cfg.field("", "this service's mesh certificate (PEM)")
    mesh_key: str = cfg.field("", "this service's mesh private key (PEM)")
    log_level: str = cfg.field("info", "debug | info | warning | error")
    shutdown_grace: float = cfg.field(5.0, "seconds in-flight calls get to finish on SIGTERM")


C = TypeVar("C", bound=ServiceConfig)


def run(role: str, config: C, main: Callable[[C], Awaitable[None]]) -> None:
    """Set up logging and tracing, log the configuration, run `main` until it returns."""
    setup_logging(role, config.log_level)
    setup_tracing(role)
    log.info("starting", config=cfg.as_dict(config))
    try:
        asyncio.run(main(config))
    except KeyboardInterrupt:
        pass
    finally:
        shutdown_tracing()
        log.info("stopped")


def advertised(config: ServiceConfig, bound: str) -> str:
    """The address to put in routes: --advertise-host (or the bind host) with the bound port."""
    port = bound.rsplit(":", 1)[1]
    host = config.advertise_host or config.host
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def resolve_model_path(model_path: str) -> str:
    """The checkpoint directory to serve: the given one, or the embedded default model."""
    if model_path:
        return model_path
    from meshlm.common.default_model import ensure_default_model

    return str(ensure_default_model())


def model_info_json(model_path: str, extra: dict[str, object]) -> str:
    """config.json of the checkpoint plus serving facts, as one JSON string."""
    import json
    from pathlib import Path

    info: dict[str, object] = {}
    config_file = Path(model_path) / "config.json"
    if config_file.exists():
        info["config"] = json.loads(config_file.read_text())
    info.update(extra)
    return json.dumps(info, default=str)
