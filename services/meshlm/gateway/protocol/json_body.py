"""Typed reads of a JSON request body (the OpenAI-shaped routes' and the scoring routes'):
each read names the field it refused, as the client wrote it, in an INVALID_ARGUMENT."""

from __future__ import annotations

from typing import Any

import orjson

from meshlm.common.errors import invalid
from meshlm.gateway.protocol.transcode import parse_json_body

# Token ids in one prompt: more than any served context length. A longer list is refused
# before its ids are looked at one by one (a 16 MiB body holds 8 M of them).
MAX_PROMPT_IDS = 1 << 20
# OpenAI fields read by no route and harmless to drop: bookkeeping (user, store, metadata,
# service_tier, safety_identifier), hints that change no output's validity (prompt_cache_key
# for cache routing, prediction for speculative decoding, verbosity).
_IGNORED = frozenset({"user", "store", "metadata", "service_tier", "safety_identifier",
                      "prompt_cache_key", "prediction", "verbosity"})


class JsonBody:
    """Typed reads of a JSON object's fields (None: absent or null); errors name the field."""

    def __init__(self, body: bytes) -> None:
        doc = parse_json_body(body)
        if not isinstance(doc, dict):
            raise invalid("body", "must be a JSON object")
        self.doc: dict[str, Any] = doc
        self.read: set[str] = set()

    def get(self, key: str) -> Any:
        self.read.add(key)
        return self.doc.get(key)

    def boolean(self, key: str) -> bool | None:
        value = self.get(key)
        if value is not None and not isinstance(value, bool):
            raise invalid(key, f"must be true or false, got {show(value)}")
        return value

    def integer(self, key: str, lo: int, hi: int) -> int | None:
        """An integer in [lo, hi]. A float without a fraction counts (3.0, as Python clients
        write computed counts; the native routes and vLLM's and SGLang's OpenAI servers take it
        too), and so does one too large for 64 bits, which the JSON parser hands over as a
        float: that one is out of range rather than "not an integer"."""
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            if not lo <= value <= hi:
                raise invalid(key, f"must be in [{lo}, {hi}], got {show(value)}")
            value = int(value)
        if not is_int(value):
            raise invalid(key, f"must be an integer, got {show(value)}")
        if not lo <= value <= hi:
            raise invalid(key, f"must be in [{lo}, {hi}], got {value}")
        return int(value)

    def number(self, key: str) -> float | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(key, f"must be a number, got {show(value)}")
        return float(value)

    def string(self, key: str) -> str | None:
        value = self.get(key)
        if value is not None and not isinstance(value, str):
            raise invalid(key, f"must be a string, got {show(value)}")
        return value

    def unsupported(self, key: str, why: str = "", allowed: tuple[Any, ...] = ()) -> None:
        """Refuse an option meshlm does not serve, unless absent, empty or `allowed`."""
        value = self.get(key)
        if value is not None and value not in allowed and value != {} and value != []:
            raise invalid(key, f"is not supported{why}")

    def check_unknown(self) -> None:
        """Refuse a field no read asked for; a null one is "not given" (as every field's null
        is here, and as SGLang's and vLLM's own extra fields are when a client sends their
        defaults as null)."""
        for key, value in self.doc.items():
            if key not in self.read and key not in _IGNORED and value is not None:
                raise invalid(key, "unknown field")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_ids(value: Any, key: str) -> bool:
    """Whether `value` is a list of token ids; one longer than MAX_PROMPT_IDS is refused first."""
    if not isinstance(value, list):
        return False
    if len(value) > MAX_PROMPT_IDS:
        raise invalid(key, f"has {len(value)} entries; a prompt has at most {MAX_PROMPT_IDS} "
                           "token ids")
    return all(is_int(t) for t in value)


def show(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."
