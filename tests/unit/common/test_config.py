from dataclasses import dataclass

from click.testing import CliRunner

from meshlm.common import config as cfg


@dataclass
class DemoConfig:
    """demo"""

    port: int = cfg.field(50051, "port")
    ratio: float = cfg.field(0.5, "ratio")
    name: str = cfg.field("x", "name")
    verbose: bool = cfg.field(False, "verbose")
    peers: tuple[str, ...] = cfg.field(("a:1",), "peers")


def _run(args: list[str], env: dict[str, str]) -> DemoConfig:
    seen: list[DemoConfig] = []

    @cfg.command(DemoConfig, "demo")
    def main(config: DemoConfig) -> None:
        seen.append(config)

    result = CliRunner().invoke(main, args, env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return seen[0]


def test_defaults_env_and_flags_in_that_order():
    assert _run([], {}) == DemoConfig()
    env = {"MESHLM_PORT": "7", "MESHLM_PEERS": "b:2, c:3", "MESHLM_VERBOSE": "true"}
    c = _run([], env)
    assert (c.port, c.peers, c.verbose) == (7, ("b:2", "c:3"), True)
    c = _run(["--port", "9", "--ratio", "0.25", "--no-verbose", "--peers", "d:4"], env)
    assert (c.port, c.ratio, c.verbose, c.peers) == (9, 0.25, False, ("d:4",))


def test_bad_value_is_a_usage_error():
    @cfg.command(DemoConfig, "demo")
    def main(config: DemoConfig) -> None:
        raise AssertionError("not reached")

    result = CliRunner().invoke(main, ["--port", "many"])
    assert result.exit_code == 2 and "--port" in result.output


def test_list_flags_repeat_and_split_on_commas():
    c = _run(["--peers", "d:4,e:5", "--peers", "f:6"], {})
    assert c.peers == ("d:4", "e:5", "f:6")


@dataclass
class SecretConfig:
    keys: tuple[str, ...] = cfg.field((), "keys", secret=True)
    name: str = cfg.field("x", "name")


def test_secret_fields_are_not_logged():
    assert cfg.as_dict(SecretConfig(keys=("k1", "k2"))) == {"keys": "<2 redacted>", "name": "x"}


def test_a_password_inside_a_url_is_masked_in_the_start_up_line():
    from meshlm.common.config import as_dict
    from meshlm.gateway.server import GatewayConfig

    config = GatewayConfig(redis_url="rediss://:s3cret-pw@redis:6379/0", redis_password="pw2")
    shown = as_dict(config)
    assert shown["redis_url"] == "rediss://:***@redis:6379/0"
    assert shown["redis_password"] == "<1 redacted>"
    assert "s3cret-pw" not in str(shown) and "pw2" not in str(shown)
