"""A flat test fake (one method per RPC, plus `is_healthy` and `model_cards`) as the api the
HTTP front takes: every RPC family, and the core, is the fake; a method the fake lacks fails
when called (routes are built for every family, but a test only calls what its fake has)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FAMILIES = ("core", "generation", "tokens", "info", "admin", "pause", "profile", "weights",
            "openai", "scoring")


class _Family:
    def __init__(self, fake: Any) -> None:
        self._fake = fake

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._fake, name, None)
        if method is not None:
            return method

        def missing(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"the fake api has no {name}")
        return missing


class FlatApi:
    def __init__(self, fake: Any) -> None:
        for family in FAMILIES:
            setattr(self, family, _Family(fake))
        self.fake = fake

    def handler(self, rpc: str) -> Callable[..., Any] | None:
        return getattr(self.fake, rpc, None)
