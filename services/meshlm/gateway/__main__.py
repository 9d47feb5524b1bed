"""python -m meshlm.gateway"""

from meshlm.common import config as cfg
from meshlm.common.service import run
from meshlm.gateway.server import GatewayConfig, serve


@cfg.command(GatewayConfig, "meshlm-gateway")
def main(config: GatewayConfig) -> None:
    run("gateway", config, serve)


if __name__ == "__main__":
    main()
