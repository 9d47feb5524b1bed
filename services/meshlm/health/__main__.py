"""python -m meshlm.health ROLE: one grpc.health.v1 Check of a service; exit 0 when SERVING.

For container health checks (Docker HEALTHCHECK, compose, Kubernetes exec probes) run beside the
service, with its environment: by default it asks 127.0.0.1 on the role's mesh port
(`MESHLM_PORT`, else the role's default) over mutual TLS with the service's own mesh certificate
(`MESHLM_MESH_CA`, `MESHLM_MESH_CERT`, `MESHLM_MESH_KEY`), checking the server's certificate
against the role's name (`MESHLM_PEER_TLS_NAME`, e.g. 'meshlm-{role}'; else 'localhost'). So a
passing probe also proves that the certificates the mesh will use are valid. `--plaintext`
asks a plaintext port instead (`--health-port`, or the gateway's public gRPC port).

Exit codes: 0 SERVING, 1 anything else (NOT_SERVING, unreachable, TLS refused), 2 bad usage.
"""

from __future__ import annotations

import os
import sys

import click
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.roles import MESH_PORTS
from meshlm.common.tls import mesh_channel_credentials


def check(address: str, credentials: grpc.ChannelCredentials | None, server_name: str | None,
          service: str, timeout: float) -> str:
    """The health status name of `service` at `address` (raises grpc.RpcError)."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (grpc.secure_channel(address, credentials, options=options) if credentials
               else grpc.insecure_channel(address))
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@click.command(name="meshlm-health")
@click.argument("role", type=click.Choice(sorted(MESH_PORTS)))
@click.option("--address", default="", help="host:port to ask (default: 127.0.0.1 and the "
                                            "role's mesh port, MESHLM_PORT if set)")
@click.option("--plaintext", is_flag=True, help="no TLS (a --health-port or public port)")
@click.option("--service", default="", help="the health service name ('' = the whole server)")
@click.option("--timeout", default=3.0, show_default=True, help="seconds for the call")
def main(role: str, address: str, plaintext: bool, service: str, timeout: float) -> None:
    """Exit 0 if the ROLE service here answers SERVING."""
    env = os.environ
    address = address or f"127.0.0.1:{env.get('MESHLM_PORT') or MESH_PORTS[role]}"
    credentials = None
    server_name = None
    if not plaintext:
        try:
            credentials = mesh_channel_credentials(
                env.get("MESHLM_MESH_CA", ""), env.get("MESHLM_MESH_CERT", ""),
                env.get("MESHLM_MESH_KEY", ""))
        except ValueError as e:
            click.echo(f"{role} {address}: {e} (set MESHLM_MESH_CA/CERT/KEY or --plaintext)",
                       err=True)
            sys.exit(2)
        template = env.get("MESHLM_PEER_TLS_NAME", "")
        server_name = template.replace("{role}", role) if template else "localhost"
    try:
        status = check(address, credentials, server_name, service, timeout)
    except grpc.RpcError as e:
        click.echo(f"{role} {address}: {e.code().name}: {e.details()}", err=True)  # type: ignore[attr-defined]
        sys.exit(1)
    click.echo(f"{role} {address}: {status}")
    sys.exit(0 if status == "SERVING" else 1)


if __name__ == "__main__":
    main()
