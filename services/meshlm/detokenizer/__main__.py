"""python -m meshlm.detokenizer"""

from meshlm.common import config as cfg
from meshlm.common.service import run
from meshlm.detokenizer.server import DetokenizerConfig, serve


@cfg.command(DetokenizerConfig, "meshlm-detokenizer")
def main(config: DetokenizerConfig) -> None:
    run("detokenizer", config, serve)


if __name__ == "__main__":
    main()
