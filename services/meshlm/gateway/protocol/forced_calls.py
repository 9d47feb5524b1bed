"""The output a forced tool call was constrained to (`tool_calls.py`), read as OpenAI tool
calls: a named function's arguments, or "required"'s JSON array of `{"name", "parameters"}`
calls. A call's first delta comes once its name is complete, then its arguments' text as it
comes."""

from __future__ import annotations

from meshlm.gateway.protocol.call_scanner import CallScanner
from meshlm.gateway.protocol.tool_call_output import CallReader, Delta, IdMaker, call_id


class ForcedCalls(CallReader):
    """A forced call's output: `named`'s arguments, or (None) "required"'s array."""

    def __init__(self, named: str | None, new_id: IdMaker = call_id) -> None:
        super().__init__(new_id)
        self._named = named
        self._array = CallScanner(2, ("parameters",)) if named is None else None

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        if not text:
            return "", []
        if self._array is None:  # a named function: the whole output is its arguments
            deltas: list[Delta] = []
            if not self._calls:
                assert self._named is not None
                self._open(self._named, deltas)
            self._arguments(text, deltas)
            return "", deltas
        deltas = []
        self._take(self._array.feed(text), deltas)
        return "", deltas
