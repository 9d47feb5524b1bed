"""Tool calls written as JSON objects `{"name": <string>, <arguments key>: <value>}` (keys in
any order, any whitespace), read character by character as they stream: the name once it is
complete, then the arguments' text as it comes. Used for "required"'s array of calls
(`forced_calls.py`) and for a model's own `<tool_call>` blocks (`tool_parsers.py`)."""

from __future__ import annotations

import json

Event = tuple[str, str]  # ("name", the name) or ("arguments", their text)


class CallScanner:
    """Reads call objects at nesting depth `depth` (1: the text is one object; 2: a JSON
    array of them) and reports ("name", name) when an object's name is complete and
    ("arguments", text) for the text of its first `keys` value as it arrives: held until
    the name is known, without the whitespace around it. Arguments written as a JSON string
    (their JSON's text, as some models write them) come whole, unquoted, once the string
    ends. With `needs_arguments` an object is a call only once its arguments begin (its
    name waits for them). `outside` is the text after the last object, outside any."""

    def __init__(self, depth: int, keys: tuple[str, ...], needs_arguments: bool = False
                 ) -> None:
        self._element_depth = depth
        self._keys = keys
        self._needs_arguments = needs_arguments
        self.outside: list[str] = []
        self._depth = 0  # of [ and { outside strings
        self._in_string = False
        self._escaped = False
        self._key: list[str] | None = None  # an element's key, while it is read
        self._read_key: str | None = None  # the key read, until its ":"
        self._value_key = ""  # the key whose value is being read ("" between values)
        self._name: list[str] = []  # the name's JSON text
        self._arguments_key = ""  # the element's arguments' key, once its value begins
        self._string: list[str] | None = None  # arguments written as a JSON string
        self._space: list[str] = []  # whitespace in the arguments, until more follows
        self.named = False  # the current element's name was reported
        self._ready_name: str | None = None  # read, not yet reported (needs_arguments)
        self._held: list[str] = []  # arguments' text before the element's name

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for ch in text:
            self._step(ch, events)
        merged: list[Event] = []
        for event in events:  # one ("arguments", text) for adjacent ones
            if merged and event[0] == merged[-1][0] == "arguments":
                merged[-1] = ("arguments", merged[-1][1] + event[1])
            else:
                merged.append(event)
        return merged

    def _step(self, ch: str, events: list[Event]) -> None:
        in_element = self._depth == self._element_depth and not self._in_string
        if self._value_key:
            if not (in_element and ch in ",}"):  # the value goes on
                self._value_char(ch, events)
                return
            self._value_done(events)
        if self._key is not None:
            self._key_char(ch)
        elif in_element and ch == '"':
            self._key, self._in_string = [], True
        elif in_element and ch == ":" and self._read_key is not None:
            self._value_key, self._read_key, self._name = self._read_key, None, []
        else:
            outside = self._depth < self._element_depth
            self._track(ch)
            if ch == "{" and self._depth == self._element_depth:  # a new element
                self.named, self._held, self._arguments_key = False, [], ""
                self._ready_name, self.outside = None, []
            elif outside:
                self.outside.append(ch)

    def _value_char(self, ch: str, events: list[Event]) -> None:
        key = self._value_key
        if key == "name":
            if self._name or not ch.isspace():
                self._name.append(ch)
        elif key == self._arguments_key:
            if self._string is not None:
                self._string.append(ch)
            elif ch.isspace():
                self._space.append(ch)
            else:
                self._arguments("".join(self._space) + ch, events)
                self._space = []
        elif key in self._keys and not self._arguments_key and not ch.isspace():
            self._arguments_key = key  # the first arguments' value begins
            self._report_name(events)
            if ch == '"':
                self._string = [ch]
            else:
                self._arguments(ch, events)
        self._track(ch)

    def _value_done(self, events: list[Event]) -> None:
        if self._value_key == "name":
            self._name_done(events)
        elif self._value_key == self._arguments_key:
            if self._string is not None:
                try:
                    text = json.loads("".join(self._string))
                except ValueError:
                    text = None
                if isinstance(text, str):
                    self._arguments(text, events)
            self._string, self._space = None, []
        self._value_key = ""

    def _arguments(self, text: str, events: list[Event]) -> None:
        if self.named:
            events.append(("arguments", text))
        else:
            self._held.append(text)

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
        self._key = None

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

    def _name_done(self, events: list[Event]) -> None:
        try:
            name = json.loads("".join(self._name))
        except ValueError:
            return
        if isinstance(name, str) and not self.named and self._ready_name is None:
            self._ready_name = name
            self._report_name(events)

    def _report_name(self, events: list[Event]) -> None:
        """The element's name, once read (and with needs_arguments, once they begin), then
        the arguments held for it."""
        if self._ready_name is None or (self._needs_arguments and not self._arguments_key):
            return
        self.named = True
        events.append(("name", self._ready_name))
        self._ready_name = None
        if self._held:
            events.append(("arguments", "".join(self._held)))
            self._held = []
