"""The output a forced tool call was constrained to (`tool_calls.py`), read as OpenAI tool
calls: a named function's arguments, or "required"'s JSON array of `{"name", "parameters"}`
calls. A call's first delta comes once its name is complete, then its arguments' text as it
comes."""

from __future__ import annotations

import json

from meshlm.gateway.protocol.tool_call_output import Call, CallReader, Delta, call_id


class ForcedCalls(CallReader):
    """A forced call's output: `named`'s arguments, or (None) "required"'s array."""

    def __init__(self, named: str | None) -> None:
        super().__init__()
        self._named = named
        self._array = _ArrayReader() if named is None else None

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        if not text:
            return "", []
        if self._array is None:  # a named function: the whole output is its arguments
            if not self._calls:
                assert self._named is not None
                self._calls.append(Call(call_id(), self._named, [text]))
                return "", [self._calls[0].opening(0, text)]
            self._calls[0].arguments.append(text)
            return "", [{"index": 0, "function": {"arguments": text}}]
        deltas: list[Delta] = []
        for event, value in self._array.feed(text):
            if event == "name":
                self._calls.append(Call(call_id(), value))
                deltas.append(self._calls[-1].opening(len(self._calls) - 1, ""))
            elif self._calls:  # arguments' text of the last call
                index = len(self._calls) - 1
                self._calls[index].arguments.append(value)
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += value
                else:
                    deltas.append({"index": index, "function": {"arguments": value}})
        return "", deltas


class _ArrayReader:
    """Reads `[{"name": <string>, "parameters": <value>}, ...]` character by character (any
    whitespace, keys in any order within an element) and reports ("name", the name) when an
    element's name is complete and ("arguments", text) for the text of its parameters' value
    as it arrives (held until the element's name is known)."""

    def __init__(self) -> None:
        self._depth = 0  # of [ and { outside strings: 1 in the array, 2 in an element
        self._in_string = False
        self._escaped = False
        self._key: list[str] | None = None  # an element's key, while it is read
        self._read_key: str | None = None  # the key read, until its ":"
        self._value_key = ""  # the key whose value is being read ("" between values)
        self._name: list[str] = []  # the name's JSON text
        self._started = False  # the parameters' value has begun
        self._named = False  # the current element's name was reported
        self._held: list[str] = []  # parameters' text before the element's name

    def feed(self, text: str) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        for ch in text:
            self._step(ch, events)
        merged: list[tuple[str, str]] = []
        for event in events:  # one ("arguments", text) for adjacent ones
            if merged and event[0] == merged[-1][0] == "arguments":
                merged[-1] = ("arguments", merged[-1][1] + event[1])
            else:
                merged.append(event)
        return merged

    def _step(self, ch: str, events: list[tuple[str, str]]) -> None:
        in_element = self._depth == 2 and not self._in_string
        if self._value_key:
            if not (in_element and ch in ",}"):  # the value goes on
                self._value_char(ch, events)
                return
            if self._value_key == "name":  # the value ends here
                self._name_done(events)
            self._value_key = ""
        if self._key is not None:
            self._key_char(ch)
        elif in_element and ch == '"':
            self._key, self._in_string = [], True
        elif in_element and ch == ":" and self._read_key is not None:
            self._value_key, self._read_key, self._name = self._read_key, None, []
        else:
            self._track(ch)
            if ch == "{" and self._depth == 2:  # a new element
                self._named, self._held = False, []

    def _value_char(self, ch: str, events: list[tuple[str, str]]) -> None:
        started = bool(self._name) if self._value_key == "name" else self._started
        if not started and ch.isspace():
            return
        if self._value_key == "name":
            self._name.append(ch)
        elif self._value_key == "parameters":
            self._started = True
            if self._named:
                events.append(("arguments", ch))
            else:
                self._held.append(ch)
        self._track(ch)

    def _key_char(self, ch: str) -> None:
        assert self._key is not None
        self._string_char(ch)
        if self._in_string:
            self._key.append(ch)
            return
        try:  # the closing quote
            self._read_key = json.loads('"' + "".join(self._key) + '"')
        except ValueError:
            self._read_key = ""
        self._key, self._started = None, False

    def _track(self, ch: str) -> None:
        """Strings and nesting, outside keys."""
        if self._in_string:
            self._string_char(ch)
        elif ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1

    def _string_char(self, ch: str) -> None:
        """One character in a string: escapes, and the closing quote."""
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False

    def _name_done(self, events: list[tuple[str, str]]) -> None:
        try:
            name = json.loads("".join(self._name))
        except ValueError:
            return
        if isinstance(name, str) and not self._named:
            self._named = True
            events.append(("name", name))
            if self._held:
                events.append(("arguments", "".join(self._held)))
                self._held = []
