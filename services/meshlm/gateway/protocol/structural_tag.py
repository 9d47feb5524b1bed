"""Structural tags (SGLang's and vLLM's, in XGrammar's form) -> an llguidance grammar. Pure.

A structural tag describes an output as a tree of formats: free text, fixed strings, JSON,
regexes and grammars, wrapped in tags and switched on by triggers (a tool call inside free
text). Two forms are taken, as the JSON text of `guided_decoding.structural_tag`:

- the current one, `{"type": "structural_tag", "format": {...}}`, whose format objects are
  const_string, json_schema (style json), grammar (EBNF or Lark), regex, any_text (with
  excludes, max_chars, max_tokens), sequence, or, optional, plus, star, repeat, tag (string
  begin, one end or several), triggered_tags and tags_with_separator;
- the earlier one, `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
  "triggers": [...]}`: free text in which each trigger starts one of the structures.

Each becomes Lark rules: a trigger ends the free text before it as llguidance's lazy lexeme,
and free text inside a tag ends at the tag's end (the lexeme's `suffix`), as XGrammar lets an
unlimited format stop at its enclosing end. Token-level formats, `dispatch` and the other JSON
styles are refused (INVALID_ARGUMENT naming the field), as is any field not listed here.
"""

from __future__ import annotations

import functools
import itertools
import json
from typing import Any

import orjson

from meshlm.common.errors import invalid
from meshlm.gateway.protocol.grammars import (
    GRAMMARS_KEPT,
    checked,
    ebnf_grammar,
    json_schema_grammar,
    regex_grammar,
)
from meshlm.gateway.protocol.json_body import show

MAX_NODES = 1024  # format objects in one tag (tags, elements, contents)
MAX_DEPTH = 32
_ANY = "(?s:.*)"
_FIELDS: dict[str, tuple[set[str], set[str]]] = {  # type -> (required, optional) fields
    "const_string": ({"value"}, set()),
    "json_schema": ({"json_schema"}, {"style", "any_order"}),
    "grammar": ({"grammar"}, set()),
    "regex": ({"pattern"}, set()),
    "any_text": (set(), {"excludes", "max_chars", "max_tokens"}),
    "sequence": ({"elements"}, set()),
    "or": ({"elements"}, set()),
    "optional": ({"content"}, set()),
    "plus": ({"content"}, set()),
    "star": ({"content"}, set()),
    "repeat": ({"content", "min", "max"}, set()),
    "tag": ({"begin", "content", "end"}, set()),
    "triggered_tags": ({"triggers", "tags"}, {"at_least_one", "stop_after_first", "excludes"}),
    "tags_with_separator": ({"tags", "separator"}, {"at_least_one", "stop_after_first"}),
}
_NOT_SERVED = {"dispatch", "token", "exclude_token", "any_tokens", "token_triggered_tags",
               "token_dispatch", "qwen_xml_parameter"}


@functools.lru_cache(maxsize=GRAMMARS_KEPT)
def structural_tag_grammar(text: str, field_path: str) -> str:
    """The llguidance grammar of a structural tag's JSON `text`; INVALID_ARGUMENT naming the
    field (under `field_path`) that is not a valid structural tag, or its part (a JSON schema,
    a regex, a grammar) that cannot be built."""
    try:
        doc = orjson.loads(text)  # nested at most 1,024 deep
    except orjson.JSONDecodeError as exc:
        raise invalid(field_path, f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise invalid(field_path, f"must be a JSON object, got {show(doc)}")
    builder = _Builder()
    kind = doc.get("type", "structural_tag")
    if kind != "structural_tag":
        raise invalid(f"{field_path}.type", f"must be structural_tag, got {show(kind)}")
    if "format" in doc:
        _only(doc, {"type", "format"}, field_path)
        top = builder.format(doc["format"], f"{field_path}.format", None, 0)[0]
    elif "structures" in doc or "triggers" in doc:
        _only(doc, {"type", "structures", "triggers"}, field_path)
        top = builder.earlier_form(doc, field_path)
    else:
        raise invalid(field_path, "give its format (or the earlier structures and triggers)")
    return checked(builder.grammar(top), field_path, "structural tag")


def _only(node: dict[str, Any], allowed: set[str], path: str) -> None:
    unknown = sorted(set(node) - allowed)
    if unknown:
        raise invalid(f"{path}.{unknown[0]}", "not a field of this format; it has "
                                              + ", ".join(sorted(allowed)))


def _literal(text: str) -> str:
    return json.dumps(text)


def _escaped(text: str) -> str:
    """`text` as a regex matching it alone, for a Lark /.../ terminal."""
    return "".join(ch if ch.isascii() and (ch.isalnum() or ch in " _")
                   else f"\\x{{{ord(ch):x}}}" for ch in text)


def _string(value: Any, path: str, empty_ok: bool = True) -> str:
    if isinstance(value, dict) and value.get("type") in ("token", "tokens"):
        raise invalid(path, "token-level begins and ends are not supported; give a string")
    if not isinstance(value, str):
        raise invalid(path, f"must be a string, got {show(value)}")
    if not value and not empty_ok:
        raise invalid(path, "must not be empty")
    return value


def _strings(value: Any, path: str, empty_ok: bool) -> list[str]:
    if not isinstance(value, list):
        raise invalid(path, f"must be a list of strings, got {show(value)}")
    return [_string(v, f"{path}[{i}]", empty_ok) for i, v in enumerate(value)]


def _flag(node: dict[str, Any], key: str, path: str) -> bool:
    value = node.get(key, False)
    if not isinstance(value, bool):
        raise invalid(f"{path}.{key}", f"must be true or false, got {show(value)}")
    return value


def _count(node: dict[str, Any], key: str, path: str, lo: int) -> int | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < 2**31:
        raise invalid(f"{path}.{key}", f"must be an integer in [{lo}, {2**31 - 1}], got "
                                       f"{show(value)}")
    return value


class _Builder:
    """Lark rules, one per format object that needs one, and the side grammars they name."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.sides: list[dict[str, str]] = []
        self.names = itertools.count()
        self.nodes = 0

    def grammar(self, top: str) -> str:
        lark = "\n".join([f"start: {top}", *self.rules]) + "\n"
        return json.dumps({"grammars": [{"lark_grammar": lark}, *self.sides]})

    def rule(self, body: str, options: str = "", terminal: bool = False) -> str:
        name = f"{'T' if terminal else 'r'}{next(self.names)}"
        self.rules.append(f"{name}{f'[{options}]' if options else ''}: {body}")
        return name

    def end_of(self, value: Any, path: str) -> str | None:
        """A tag's end (a string, or a list of them: any one ends it) as a terminal; None
        for an empty one."""
        ends = ([_string(value, path)] if not isinstance(value, list)
                else _strings(value, path, empty_ok=False))
        if not ends:
            raise invalid(path, "give at least one end")
        if ends == [""]:
            return None
        return self.rule(" | ".join(_literal(e) for e in ends), terminal=True)

    # Each format gives a Lark expression, and whether it took in `end` (the enclosing tag's
    # end terminal, if any): free text ends where that end is written.

    def format(self, node: Any, path: str, end: str | None, depth: int) -> tuple[str, bool]:
        self.nodes += 1
        if self.nodes > MAX_NODES or depth > MAX_DEPTH:
            raise invalid(path, f"the structural tag is too large: at most {MAX_NODES} "
                                f"formats, nested at most {MAX_DEPTH} deep")
        if not isinstance(node, dict):
            raise invalid(path, f"must be a format object, got {show(node)}")
        kind = node.get("type")
        if kind in _NOT_SERVED:
            raise invalid(f"{path}.type", f"{kind} is not supported; give a string-level "
                                          "format: " + ", ".join(_FIELDS))
        if kind not in _FIELDS:
            raise invalid(f"{path}.type", f"must be one of {', '.join(_FIELDS)}, got "
                                          f"{show(kind)}")
        required, optional = _FIELDS[kind]
        _only(node, required | optional | {"type"}, path)
        missing = sorted(required - set(node))
        if missing:
            raise invalid(f"{path}.{missing[0]}", "is required")
        return getattr(self, "_" + kind)(node, path, end, depth + 1)  # type: ignore[no-any-return]

    def _const_string(self, node: dict[str, Any], path: str, end: str | None,
                      depth: int) -> tuple[str, bool]:
        value = _string(node["value"], f"{path}.value")
        return (_literal(value) if value else '""'), False

    def _json_schema(self, node: dict[str, Any], path: str, end: str | None,
                     depth: int) -> tuple[str, bool]:
        if node.get("style", "json") != "json":
            raise invalid(f"{path}.style", f"only json is supported, got {show(node['style'])}")
        if _flag(node, "any_order", path):
            raise invalid(f"{path}.any_order", "is not supported: properties come in their "
                                               "schema's order")
        return self.json_part(node["json_schema"], f"{path}.json_schema"), False

    def json_part(self, schema: Any, path: str) -> str:
        if not isinstance(schema, dict | bool):
            raise invalid(path, f"must be a JSON schema, got {show(schema)}")
        return self.side(json_schema_grammar(json.dumps(schema), path))

    def _grammar(self, node: dict[str, Any], path: str, end: str | None,
                 depth: int) -> tuple[str, bool]:
        text = _string(node["grammar"], f"{path}.grammar", empty_ok=False)
        return self.side(ebnf_grammar(text, f"{path}.grammar")), False

    def _regex(self, node: dict[str, Any], path: str, end: str | None,
               depth: int) -> tuple[str, bool]:
        pattern = _string(node["pattern"], f"{path}.pattern")
        return self.side(regex_grammar(pattern, f"{path}.pattern")), False

    def side(self, grammar: str) -> str:
        """A built grammar (llguidance's JSON of one grammar, or Lark) as a named side grammar."""
        name = f"g{next(self.names)}"
        if grammar.lstrip().startswith("{"):
            [part] = json.loads(grammar)["grammars"]
            part = {k: v for k, v in part.items() if v is not None}
        else:
            part = {"lark_grammar": grammar}
        self.sides.append({**part, "name": name})
        return "@" + name

    def text(self, excludes: list[str], end: str | None, max_chars: int | None = None,
             max_tokens: int | None = None) -> str:
        """Free text without any of `excludes`, ending with `end` if given."""
        options = [f"suffix={end}"] if end else []
        if max_tokens is not None:
            options.append(f"max_tokens={max_tokens}")
        terminal = self.text_terminal(excludes, max_chars)
        return self.rule(terminal, ", ".join(options)) if options else terminal

    def text_terminal(self, excludes: list[str], max_chars: int | None = None) -> str:
        body = f"/(?s:.{{0,{max_chars}}})/" if max_chars is not None else f"/{_ANY}/"
        if excludes:
            body += f" & ~/{_ANY}({'|'.join(_escaped(e) for e in excludes)}){_ANY}/"
        return self.rule(body, terminal=True)

    def _any_text(self, node: dict[str, Any], path: str, end: str | None,
                  depth: int) -> tuple[str, bool]:
        excludes = _strings(node.get("excludes", []), f"{path}.excludes", empty_ok=False)
        return self.text(excludes, end, _count(node, "max_chars", path, 0),
                         _count(node, "max_tokens", path, 0)), True

    def elements(self, node: dict[str, Any], path: str) -> list[Any]:
        elements = node["elements"]
        if not isinstance(elements, list) or not elements:
            raise invalid(f"{path}.elements", "must be a non-empty list of formats")
        return elements

    def _sequence(self, node: dict[str, Any], path: str, end: str | None,
                  depth: int) -> tuple[str, bool]:
        elements = self.elements(node, path)
        parts = [self.format(e, f"{path}.elements[{i}]", None, depth)[0]
                 for i, e in enumerate(elements[:-1])]
        last, took = self.format(elements[-1], f"{path}.elements[{len(elements) - 1}]", end,
                                 depth)
        return self.rule(" ".join([*parts, last])), took

    def _or(self, node: dict[str, Any], path: str, end: str | None,
            depth: int) -> tuple[str, bool]:
        parts = [self.format(e, f"{path}.elements[{i}]", end, depth)
                 for i, e in enumerate(self.elements(node, path))]
        if not any(took for _, took in parts):
            return self.rule(" | ".join(p for p, _ in parts)), False
        return self.rule(" | ".join(p if took else f"{p} {end}" for p, took in parts)), True

    def _repeated(self, node: dict[str, Any], path: str, depth: int, suffix: str) -> str:
        inner = self.format(node["content"], f"{path}.content", None, depth)[0]
        return self.rule(f"({inner}){suffix}")

    def _optional(self, node: dict[str, Any], path: str, end: str | None,
                  depth: int) -> tuple[str, bool]:
        return self._repeated(node, path, depth, "?"), False

    def _plus(self, node: dict[str, Any], path: str, end: str | None,
              depth: int) -> tuple[str, bool]:
        return self._repeated(node, path, depth, "+"), False

    def _star(self, node: dict[str, Any], path: str, end: str | None,
              depth: int) -> tuple[str, bool]:
        return self._repeated(node, path, depth, "*"), False

    def _repeat(self, node: dict[str, Any], path: str, end: str | None,
                depth: int) -> tuple[str, bool]:
        low = _count(node, "min", path, 0)
        high = node["max"]
        if high != -1:
            high = _count(node, "max", path, low or 0)
        bounds = f"{{{low},}}" if high == -1 else f"{{{low},{high}}}"
        return self._repeated(node, path, depth, bounds), False

    def _tag(self, node: dict[str, Any], path: str, end: str | None,
             depth: int, begin_from: int = 0) -> tuple[str, bool]:
        """begin, content, end; `begin_from`: how much of begin a trigger already wrote."""
        begin = _string(node["begin"], f"{path}.begin")[begin_from:]
        own_end = self.end_of(node["end"], f"{path}.end")
        content, took = self.tag_content(node, path, own_end, depth)
        parts = [_literal(begin)] if begin else []
        parts.append(content)
        if own_end is not None and not took:
            parts.append(own_end)
        return self.rule(" ".join(parts)), False

    def tag_content(self, node: dict[str, Any], path: str, end: str | None,
                    depth: int) -> tuple[str, bool]:
        if "schema" in node:  # the earlier form's structure: a JSON schema
            return self.json_part(node["schema"], f"{path}.schema"), False
        return self.format(node["content"], f"{path}.content", end, depth)

    def tags(self, node: dict[str, Any], path: str, depth: int) -> list[dict[str, Any]]:
        tags = node["tags"]
        if not isinstance(tags, list) or not tags:
            raise invalid(f"{path}.tags", "must be a non-empty list of tag formats")
        for i, tag in enumerate(tags):
            if not isinstance(tag, dict) or tag.get("type") != "tag":
                raise invalid(f"{path}.tags[{i}]", "must be a format of type tag")
        return tags

    def _triggered_tags(self, node: dict[str, Any], path: str, end: str | None,
                        depth: int) -> tuple[str, bool]:
        triggers = _strings(node["triggers"], f"{path}.triggers", empty_ok=False)
        tags = self.tags(node, path, depth)
        excludes = _strings(node.get("excludes", []), f"{path}.excludes", empty_ok=False)
        return self.triggered(triggers, [(t, f"{path}.tags[{i}]") for i, t in enumerate(tags)],
                              path, end, depth, excludes, _flag(node, "at_least_one", path),
                              _flag(node, "stop_after_first", path)), True

    def triggered(self, triggers: list[str], tags: list[tuple[dict[str, Any], str]],
                  path: str, end: str | None, depth: int, excludes: list[str],
                  at_least_one: bool, stop_after_first: bool) -> str:
        """Free text in which each trigger starts one of the tags whose begin it leads."""
        if not triggers:
            raise invalid(f"{path}.triggers", "give at least one trigger")
        calls, whole = [], []
        for trigger in triggers:
            led = [(tag, tag_path) for tag, tag_path in tags
                   if isinstance(tag.get("begin"), str) and tag["begin"].startswith(trigger)]
            if not led:
                continue
            rest = [self.format_tag(tag, tag_path, depth, len(trigger)) for tag, tag_path in led]
            lead = self.rule(f"{self.text_terminal(excludes)} {_literal(trigger)}", "lazy")
            calls.append(self.rule(f"{lead} ({' | '.join(rest)})"))
            if at_least_one:  # the first tag, with no text before it
                whole += [self.format_tag(tag, tag_path, depth) for tag, tag_path in led]
        for tag, tag_path in tags:
            begin = _string(tag.get("begin"), f"{tag_path}.begin")
            led_by = [t for t in triggers if begin.startswith(t)]
            if len(led_by) != 1:
                raise invalid(f"{tag_path}.begin", f"must start with exactly one of the "
                                                   f"triggers, got {show(begin)}")
        call = " | ".join(calls)
        first = " | ".join(whole)
        text = self.text(excludes, end)
        then_end = f" {end}" if end else ""
        if at_least_one and stop_after_first:
            return self.rule(f"({first}){then_end}")
        if stop_after_first:
            return self.rule(f"({call}){then_end} | {text}")
        if at_least_one:
            return self.rule(f"({first}) ({call})* {text}")
        return self.rule(f"({call})* {text}")

    def format_tag(self, tag: dict[str, Any], path: str, depth: int, begin_from: int = 0
                   ) -> str:
        self.nodes += 1
        if "schema" not in tag:
            required, optional = _FIELDS["tag"]
            _only(tag, required | {"type"}, path)
            missing = sorted(required - set(tag))
            if missing:
                raise invalid(f"{path}.{missing[0]}", "is required")
        return self._tag(tag, path, None, depth + 1, begin_from)[0]

    def _tags_with_separator(self, node: dict[str, Any], path: str, end: str | None,
                             depth: int) -> tuple[str, bool]:
        tags = self.tags(node, path, depth)
        separator = _string(node["separator"], f"{path}.separator")
        one = self.rule(" | ".join(self.format_tag(t, f"{path}.tags[{i}]", depth)
                                   for i, t in enumerate(tags)))
        at_least_one = _flag(node, "at_least_one", path)
        if _flag(node, "stop_after_first", path):
            return (one if at_least_one else self.rule(f"{one}?")), False
        more = f"({_literal(separator)} {one})*" if separator else f"{one}*"
        listed = f"{one} {more}"
        return self.rule(listed if at_least_one else f"({listed})?"), False

    def earlier_form(self, doc: dict[str, Any], path: str) -> str:
        """{"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
        structures = doc.get("structures")
        if not isinstance(structures, list) or not structures:
            raise invalid(f"{path}.structures", "must be a non-empty list of {begin, schema, "
                                                "end} objects")
        tags = []
        for i, s in enumerate(structures):
            s_path = f"{path}.structures[{i}]"
            if not isinstance(s, dict):
                raise invalid(s_path, f"must be a {{begin, schema, end}} object, got {show(s)}")
            _only(s, {"begin", "schema", "end"}, s_path)
            for key in ("begin", "schema", "end"):
                if key not in s:
                    raise invalid(f"{s_path}.{key}", "is required")
            tags.append((s, s_path))
        triggers = _strings(doc.get("triggers"), f"{path}.triggers", empty_ok=False)
        return self.triggered(triggers, tags, path, None, 0, [], False, False)

