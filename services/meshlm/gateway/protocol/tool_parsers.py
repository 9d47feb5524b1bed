"""The models' own tool-call formats, read for tool_choice "auto" (the gateway's
`--tool-call-parser`; vLLM's names, and SGLang's for the same formats):

- `HermesCalls` (`hermes`, SGLang's `qwen25`): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks (Hermes 2 Pro and later, Qwen2.5 and Qwen3), any text before
  and between them being content. A block is read as it streams: its call's first delta
  once the name is complete, then the arguments' text as it comes (vLLM streams them so
  too); text that may begin a tag is held until it is clear. A block that names no call
  stays content.
- `JsonCalls` (`llama3_json`, `llama4_json`, SGLang's `llama3`): Llama 3.1 and later's JSON
  calls, an output that starts with `<|python_tag|>` or `{` being `{"name", "parameters"}`
  objects separated by `;`, each read as it streams once its arguments begin.
- `MistralCalls` (`mistral`): `[TOOL_CALLS]` then a JSON array of calls, or (Mistral's
  tokenizers v11 and later) `name[ARGS]{...}` per call; ids of nine letters and digits.
- `PythonicCalls` (`pythonic`): Llama 3.2 and 4's `[f(a=1), g(b="x")]`, each call read as
  it closes.
- `qwen3_coder`, `glm45` / `glm47`: calls with tagged parameters (`xml_calls.py`).
- `deepseek_v3`, `deepseek_v31`, `kimi_k2`: DeepSeek's and Kimi K2's calls between their
  special tokens (`deepseek_calls.py`).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from meshlm.gateway.protocol.block_calls import BlockCalls
from meshlm.gateway.protocol.call_scanner import CallScanner
from meshlm.gateway.protocol.deepseek_calls import (
    DeepSeekV3Calls,
    DeepSeekV31Calls,
    KimiK2Calls,
)
from meshlm.gateway.protocol.text_tags import partial_tag
from meshlm.gateway.protocol.tool_call_output import (
    CallReader,
    Delta,
    IdMaker,
    kimi_call_id,
    mistral_call_id,
)
from meshlm.gateway.protocol.xml_calls import Glm45Calls, Qwen3CoderCalls


class HermesCalls(BlockCalls):
    """`<tool_call>{json}</tool_call>` blocks among content, each read as it streams."""

    def __init__(self) -> None:
        super().__init__()
        self._block = CallScanner(1, ("arguments", "parameters"))  # the open block's reader
        self._body: list[str] = []  # the open block's text

    def _begin(self) -> None:
        self._block, self._body = CallScanner(1, ("arguments", "parameters")), []

    def _read(self, text: str, deltas: list[Delta]) -> None:
        """More of the open block: its call's name once complete, then its arguments."""
        self._body.append(text)
        self._take(self._block.feed(text), deltas)

    def _close(self, content: list[str], deltas: list[Delta], closed: bool) -> None:
        """The block ends (`closed`: with its tag; else the output ends in it): a call once
        named (closed without arguments: `{}`); otherwise a call if its JSON reads as one
        whole, else content as written."""
        named, body = self._block.named, "".join(self._body)
        if named:
            if closed and not self._calls[-1].arguments:
                self._arguments("{}", deltas)
            return
        try:
            call = _json_call(json.loads(body), ("arguments", "parameters"), required=False)
        except ValueError:
            call = None
        if call is None:
            content.append(self.OPEN + body + (self.CLOSE if closed else ""))
            return
        deltas.append(self._called(*call))


class JsonCalls(CallReader):
    """Llama 3.1+'s JSON tool calls: an output that starts with `<|python_tag|>` or `{` is
    calls, `{"name": ..., "parameters": {...}}` objects one after another (`;` between them),
    each read as it streams once its arguments begin; any other output is content, and so is
    one that names no call by its end, or text after the last call."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # the output's start, until it is clear
        self._scanner: CallScanner | None = None  # the calls' reader, in calls mode
        self._text: list[str] = []  # the calls' text, content if none is named
        self._calls_mode: bool | None = None  # undecided until the output's start is seen

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        if self._calls_mode is None:
            self._pending += text
            start = self._pending.lstrip()
            if not last and (not start or (self.TAG.startswith(start) and start != self.TAG)):
                return "", []  # not yet clear
            self._calls_mode = start.startswith((self.TAG, "{"))
            text = start.removeprefix(self.TAG) if self._calls_mode else self._pending
            self._pending = ""
            if self._calls_mode:
                self._scanner = CallScanner(1, ("parameters", "arguments"),
                                            needs_arguments=True)
        if not self._calls_mode:
            if text:
                self._content.append(text)
            return text, []
        assert self._scanner is not None
        deltas: list[Delta] = []
        self._text.append(text)
        self._take(self._scanner.feed(text), deltas)
        if not last:
            return "", deltas
        content = ("".join(self._scanner.outside).lstrip(" \t\n;") if self._calls
                   else "".join(self._text))
        if content:
            self._content.append(content)
        return content, deltas


class MistralCalls(CallReader):
    """Mistral's `[TOOL_CALLS]`, after any content: then either a JSON array of
    `{"name", "arguments"}` calls (tokenizers before v11: Mistral 7B v0.3, Mixtral 8x22B,
    Mistral Nemo), or each call as `name[ARGS]{arguments}` (v11 and later: Mistral Small 3.2,
    Magistral, Devstral; `name[CALL_ID]id[ARGS]...` keeps the model's id), another
    `[TOOL_CALLS]` before each further call. Read as they stream; ids are Mistral's nine
    letters and digits, which its chat templates require of earlier calls."""

    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def __init__(self, new_id: IdMaker = mistral_call_id) -> None:
        super().__init__(new_id)
        self._pending = ""  # not yet read
        self._mode = ""  # "": content; "start": after the tag; "json"; "name"; "arguments"
        self._scanner: CallScanner | None = None  # the array's or a call's arguments' reader

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        self._pending += text
        content: list[str] = []
        deltas: list[Delta] = []
        while self._step(content, deltas, last):
            pass
        text_out = "".join(content)
        if text_out:
            self._content.append(text_out)
        return text_out, deltas

    def _step(self, content: list[str], deltas: list[Delta], last: bool) -> bool:
        """Read what can be read of the pending text; True to go on."""
        pending = self._pending
        if self._mode == "json":  # the array (or object) of calls, to the end
            assert self._scanner is not None
            self._take(self._scanner.feed(pending), deltas)
            self._pending = ""
            return False
        if self._mode in ("", "arguments"):  # content, or a call's arguments, to a tag
            at = pending.find(self.TAG)
            end = at if at >= 0 else len(pending) - (0 if last else
                                                     partial_tag(pending, self.TAG))
            if self._mode == "":
                if end:
                    content.append(pending[:end])
            else:
                assert self._scanner is not None
                self._take(self._scanner.feed(pending[:end]), deltas)
            if at < 0:
                self._pending = pending[end:]
                return False
            self._pending, self._mode = pending[at + len(self.TAG):], "start"
            return True
        if self._mode == "start":
            start = pending.lstrip()
            if not start and not last:
                return False
            if start[:1] in ("[", "{"):
                self._mode, self._pending = "json", start
                self._scanner = CallScanner(2 if start[0] == "[" else 1, ("arguments",))
            else:
                self._mode = "name"
            return bool(start)
        # "name": up to [ARGS], maybe by way of [CALL_ID]
        at = pending.find(self.ARGS)
        if at < 0:
            if last and pending.strip():
                content.append(self.TAG + pending)  # a name without arguments: not a call
                self._pending = ""
            return False
        name, _, given_id = pending[:at].partition(self.CALL_ID)
        self._open(name.strip(), deltas, given_id.strip())
        self._scanner = CallScanner(1, ("arguments",))
        self._scanner.feed('{"name": "", "arguments": ')  # the call is open: read its arguments
        self._pending, self._mode = pending[at + len(self.ARGS):], "arguments"
        return True


class PythonicCalls(CallReader):
    """Calls written as a Python list of calls with keyword arguments,
    `[get_weather(city="Paris"), get_time(zone="UTC")]` (Llama 3.2 and 4's pythonic form): an
    output that starts with `[` is read as such a list, each call given once it closes (each
    argument a Python literal, given as JSON). Any other output is content; so is one whose
    first entry is not such a call, and, after the calls read, what does not read as one."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""  # the output so far, from its start
        self._calls_mode: bool | None = None  # undecided until its first character
        self._scanned = 0  # of _text, read by the scanner
        self._depth = 0  # brackets open
        self._quote = ""  # the open string's quote
        self._escaped = False
        self._call_at = -1  # where the open call begins (-1: none)
        self._given = 0  # where the content begins once the calls end (0: all of it)
        self._ended = False  # the list closed, or an entry was not a call

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        self._text += text
        if self._calls_mode is None:
            start = self._text.lstrip()
            if not start and not last:
                return "", []
            self._calls_mode = start.startswith("[")
            if not self._calls_mode:  # content, with the white space held until now
                return self._as_content(self._text), []
        if not self._calls_mode:
            return self._as_content(text), []
        deltas: list[Delta] = []
        if not self._ended:
            self._scan(deltas)
        if last and not self._ended:  # cut in the list: what is not a whole call is content
            self._end(self._call_at if self._call_at >= 0 else self._given)
        if not self._ended:
            return "", deltas
        rest, self._given = self._text[self._given:], len(self._text)
        return self._as_content(rest), deltas

    def _as_content(self, text: str) -> str:
        if text:
            self._content.append(text)
        return text

    def _scan(self, deltas: list[Delta]) -> None:
        """Read on from where the scan stopped: calls as they close, the list's end."""
        text = self._text
        for i in range(self._scanned, len(text)):
            ch = text[i]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = ""
            elif ch in "'\"":
                self._quote = ch
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if self._depth == 1 and ch == ")" and self._call_at >= 0:
                    if not self._call(text[self._call_at:i + 1], deltas):
                        break
                    self._call_at, self._given = -1, i + 1
                elif self._depth == 0 and ch == "]" and self._call_at < 0 and self._calls:
                    self._ended, self._given = True, i + 1  # the list closed after its calls
                    break
                elif self._depth <= 0:  # not a list of calls
                    self._end(self._call_at if self._call_at >= 0 else i)
                    break
            elif self._depth == 1 and self._call_at < 0 and not ch.isspace() and ch != ",":
                if not (ch.isalpha() or ch == "_"):
                    self._end(i)
                    break
                self._call_at = i
            self._scanned = i + 1

    def _call(self, text: str, deltas: list[Delta]) -> bool:
        """One whole call: given, or (not a call) the reading ends."""
        parsed = _python_calls(f"[{text}]")
        if parsed is None:
            self._end(self._call_at)
            return False
        [(name, arguments)] = parsed
        deltas.append(self._called(name, json.dumps(arguments, ensure_ascii=False)))
        return True

    def _end(self, at: int) -> None:
        """The calls end: content from `at`, where what is not a call begins (all of the
        output, the list's `[` too, when no call was read)."""
        self._ended, self._given = True, at if self._calls else 0


def _json_call(doc: Any, keys: tuple[str, str], required: bool) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call written as a JSON object with a "name" and its
    arguments under one of `keys` (an object, or its JSON text; absent: none, unless
    `required`); None when `doc` is not such a call."""
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        return None
    given = [doc[key] for key in keys if key in doc]
    if not given and required:
        return None
    arguments = given[0] if given else {}
    if isinstance(arguments, str):  # some models write the arguments' JSON as a string
        try:
            as_object = json.loads(arguments)
        except ValueError:
            return None
        return (doc["name"], arguments) if isinstance(as_object, dict) else None
    if not isinstance(arguments, dict):
        return None
    return doc["name"], json.dumps(arguments, ensure_ascii=False)


def _python_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """`[f(a=1), g(b="x")]` as (name, arguments) pairs; None when it is not such a list."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and not node.args and all(k.arg for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            json.dumps(arguments)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append((node.func.id, arguments))
    return calls


# --tool-call-parser's names: vLLM's, and SGLang's for the same formats.
PARSERS: dict[str, type[CallReader]] = {"hermes": HermesCalls, "qwen25": HermesCalls,
                                        "llama3_json": JsonCalls, "llama4_json": JsonCalls,
                                        "llama3": JsonCalls, "pythonic": PythonicCalls,
                                        "mistral": MistralCalls,
                                        "qwen3_coder": Qwen3CoderCalls, "glm45": Glm45Calls,
                                        "glm47": Glm45Calls,
                                        "deepseek_v3": DeepSeekV3Calls,
                                        "deepseekv3": DeepSeekV3Calls,
                                        "deepseek_v31": DeepSeekV31Calls,
                                        "deepseekv31": DeepSeekV31Calls, "kimi_k2": KimiK2Calls}
# The ids a parser's models need for their calls (a forced call's too); others: call_id's.
CALL_IDS: dict[str, IdMaker] = {"mistral": mistral_call_id, "kimi_k2": kimi_call_id}
