"""Service configuration: one dataclass per service, filled from CLI flags and MESHLM_* env vars.

A field `grpc_port` becomes the flag `--grpc-port` and the variable `MESHLM_GRPC_PORT`; the
flag wins over the variable, the variable over the default. Field metadata "help" documents it.
List fields (tuple[str, ...]) take a comma-separated value or a repeated flag. A `secret` field
(an API key) is never logged: the start-up line shows how many values it has, not them.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import click

C = TypeVar("C")

ENV_PREFIX = "MESHLM_"


def field(default: Any, help: str, secret: bool = False) -> Any:
    """A config field with its help text; `secret` keeps its value out of logs."""
    if isinstance(default, list | dict | set):
        raise TypeError("use a tuple for list defaults")
    return dataclasses.field(default=default, metadata={"help": help, "secret": secret})


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def _option(f: dataclasses.Field[Any], tp: Any) -> Callable[[Callable[..., Any]], Any]:
    name = f.name.replace("_", "-")
    env = ENV_PREFIX + f.name.upper()
    help_text = f.metadata.get("help", "")
    base = _base_type(tp)
    default = f.default
    if base is bool:
        return click.option(
            f"--{name}/--no-{name}", default=default, envvar=env, show_envvar=True,
            show_default=True, help=help_text,
        )
    if typing.get_origin(base) is tuple:
        return click.option(
            f"--{name}", multiple=True, default=default, envvar=env, show_envvar=True,
            show_default=",".join(typing.cast(tuple[str, ...], default)) or False,
            help=help_text + " (comma-separated or repeated)",
        )
    click_type = {int: int, float: float, str: str}.get(base, str)
    return click.option(
        f"--{name}", type=click_type, default=default, envvar=env, show_envvar=True,
        show_default=True, help=help_text,
    )


def from_values(cls: type[C], values: dict[str, Any]) -> C:
    """Build the dataclass from raw option values (comma lists split into tuples)."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in values:
            continue
        value = values[f.name]
        if typing.get_origin(_base_type(hints[f.name])) is tuple:
            items = [value] if isinstance(value, str) else value
            value = tuple(v.strip() for item in items for v in item.split(",") if v.strip())
        kwargs[f.name] = value
    return cls(**kwargs)


def command(cls: type[C], name: str) -> Callable[[Callable[[C], None]], click.Command]:
    """Decorator: turn `main(config)` into a click command whose options are cls's fields."""
    hints = typing.get_type_hints(cls)

    def wrap(main: Callable[[C], None]) -> click.Command:
        def run(**values: Any) -> None:
            main(from_values(cls, values))

        cmd: Any = run
        for f in reversed(dataclasses.fields(cls)):  # type: ignore[arg-type]
            cmd = _option(f, hints[f.name])(cmd)
        return click.command(name=name, help=cls.__doc__)(cmd)

    return wrap


def as_dict(config: Any) -> dict[str, Any]:
    """For the start-up log line: secret fields show how many values they hold, not them, and
    a password inside a URL shows as *** (other secrets are never config values, only paths)."""
    out = dataclasses.asdict(config)
    for f in dataclasses.fields(config):
        if f.metadata.get("secret"):
            value = out[f.name]
            count = len(value) if isinstance(value, tuple) else int(bool(value))
            out[f.name] = f"<{count} redacted>"
        elif isinstance(out[f.name], str):
            out[f.name] = _URL_PASSWORD.sub(r"\1***@", out[f.name])
    return out


# scheme://user:password@host: a password written into a URL (redis://:pw@redis:6379)
_URL_PASSWORD = re.compile(r"(\w[\w+.-]*://[^:/@\s]*:)[^@/\s]+@")
