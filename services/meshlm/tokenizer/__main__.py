"""python -m meshlm.tokenizer"""

from meshlm.common import config as cfg
from meshlm.common.service import run
from meshlm.tokenizer.server import TokenizerConfig, serve


@cfg.command(TokenizerConfig, "meshlm-tokenizer")
def main(config: TokenizerConfig) -> None:
    run("tokenizer", config, serve)


if __name__ == "__main__":
    main()
