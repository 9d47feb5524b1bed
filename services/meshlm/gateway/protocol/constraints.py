"""Constrained decoding: the public request's constraint -> the llguidance grammar the engine
follows (`common.SamplingParams.grammar`). Pure: no I/O.

One constraint per request, from SglangService's SamplingParams: `json_schema` or `regex`
(upstream's deprecated fields 14 and 15) or `guided_decoding` (a JSON schema, a regex, an EBNF
grammar in llama.cpp's GBNF form or Lark, or a choice of strings). The routes' own spellings
(SGLang's native `json_schema`, `regex`, `ebnf`; OpenAI's `response_format`; vLLM's
`structured_outputs` and `guided_*`) are put into `guided_decoding` by their parsers
(`openai_constraint`, native.py). Each is turned into a grammar and checked here, so a schema
or regex that cannot be followed is refused (400, naming the field) before anything else sees
the request (the builders: grammars.py; structural tags: structural_tag.py).
"""

from __future__ import annotations

import json
from typing import Any

from meshlm.common.errors import invalid
from meshlm.gateway.protocol.grammars import (
    choice_grammar,
    ebnf_grammar,
    json_schema_grammar,
    regex_grammar,
)
from meshlm.gateway.protocol.json_body import JsonBody, show
from meshlm.gateway.protocol.structural_tag import structural_tag_grammar
from sglang.runtime.v1 import sglang_pb2

# A constraint this large or smaller is built where it is checked, on the gateway's event
# loop (1-2 ms at most); a larger one is checked on a worker thread (`large_constraint`), as
# its build grows faster than its size (a schema of 5,000 properties: 0.6 s), so one client's
# schema never stalls the other streams. llguidance bounds the build itself.
INLINE_CONSTRAINT_BYTES = 2048
# Constrained decoding beside response_format: SGLang's fields, then vLLM's (older and
# current), each with the kind of constraint it gives.
_CONSTRAINTS = (("regex", "regex"), ("ebnf", "ebnf"), ("json_schema", "json_schema"),
                ("guided_json", "json_schema"), ("guided_regex", "regex"),
                ("guided_choice", "choice"), ("guided_grammar", "ebnf"),
                ("structural_tag", "structural_tag"))
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf",
               "structural_tag": "structural_tag"}


def grammar_of(p: sglang_pb2.SamplingParams, prefix: str = "sampling_params") -> str:
    """The grammar of `p`'s constraint ("" when it has none); INVALID_ARGUMENT naming the field
    for two constraints, or one that is not a valid schema, regex or grammar."""
    given = [f for f in ("json_schema", "regex", "guided_decoding") if p.HasField(f)]
    if not given:
        return ""
    if len(given) > 1:
        raise invalid(f"{prefix}.{given[1]}", f"give one constraint; {prefix}.{given[0]} is "
                                              "given too")
    kind = given[0]
    if kind == "json_schema":
        return json_schema_grammar(p.json_schema, f"{prefix}.json_schema")
    if kind == "regex":
        return regex_grammar(p.regex, f"{prefix}.regex")
    guided = p.guided_decoding
    which = guided.WhichOneof("constraint")
    field_path = f"{prefix}.guided_decoding.{which}"
    if which is None:
        raise invalid(f"{prefix}.guided_decoding", "names no constraint; give json_schema, "
                                                   "regex, ebnf, choice or structural_tag")
    if which == "structural_tag":
        return structural_tag_grammar(guided.structural_tag, field_path)
    if which == "json_schema":
        return json_schema_grammar(guided.json_schema, field_path)
    if which == "regex":
        return regex_grammar(guided.regex, field_path)
    if which == "ebnf":
        return ebnf_grammar(guided.ebnf, field_path)
    return choice_grammar(tuple(guided.choice.values), f"{field_path}.values")


# A reasoning model's thinking before the constraint: free text up to its closing tag (kept
# in the output, for the reasoning parser), a few blanks (templates put two newlines there;
# a bound, or a model could write nothing else), then the constrained answer.
_ANSWER = 'answer: /[ \\t\\r\\n]{0,4}/ @meshlm_answer\n'


def think_first(grammar: str, starts_in_thought: bool,
                tags: tuple[str, str] = ("<think>", "</think>")) -> str:
    """`grammar` (one built here) after a reasoning model's thinking, as vLLM applies a
    constraint once the reasoning ends: the output starts in thought (`starts_in_thought`:
    its template opened it) or may open a thinking block first (`tags`: its opening and
    closing tags)."""
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {
        "grammars": [{"lark_grammar": grammar}]}
    answer, *sides = top["grammars"]  # the first is the whole answer's; it may name the others
    opening, closing = (json.dumps(tag) for tag in tags)
    start = ("start: thinking answer\n" if starts_in_thought
             else f"start: answer | {opening} thinking answer\n")
    lark = start + f"thinking[suffix={closing}]: /(.|\\n)*/\n" + _ANSWER
    top["grammars"] = [{"lark_grammar": lark}, {**answer, "name": "meshlm_answer"}, *sides]
    return json.dumps(top)


def large_constraint(p: sglang_pb2.SamplingParams) -> bool:
    """Whether `p`'s constraint is too large to build on the event loop."""
    size = len(p.json_schema) + len(p.regex)
    if p.HasField("guided_decoding"):
        size += p.guided_decoding.ByteSize()
    return size > INLINE_CONSTRAINT_BYTES


# ---- the routes' spellings -> guided_decoding -------------------------------------------------


def set_guided(p: sglang_pb2.SamplingParams, kind: str, value: Any) -> None:
    """Put one constraint of `kind` (json_schema, regex, ebnf, choice, structural_tag) into
    p.guided_decoding; a JSON schema or a structural tag may be given as an object or as its
    text."""
    guided = p.guided_decoding
    if kind == "choice":
        guided.choice.values.extend(value)
    elif kind in ("json_schema", "structural_tag") and not isinstance(value, str):
        setattr(guided, kind, json.dumps(value))
    else:
        setattr(guided, kind, value)


def openai_constraint(b: JsonBody, p: sglang_pb2.SamplingParams,
                      names: dict[str, str]) -> None:
    """The output's constraint, by OpenAI's response_format or by SGLang's or vLLM's own
    fields (one of them), into p.guided_decoding; `names` learns the field the client wrote.
    The gateway's validation builds and checks the grammar (`grammar_of`)."""
    found: list[tuple[str, str, Any]] = []  # (the client's field, kind, value)
    fmt = b.get("response_format")
    if fmt is not None:
        found += _response_format(fmt)
    for key, kind in _CONSTRAINTS:
        value = b.get(key)
        if value is not None:
            found.append((key, kind, value))
    structured = b.get("structured_outputs")
    flexible = False  # vLLM's disable_any_whitespace: false, given: JSON with any whitespace
    if structured is not None:
        found += _structured_outputs(structured)
        flexible = structured.get("disable_any_whitespace") is False
    b.string("guided_decoding_backend")  # vLLM's older backend choice: one backend here
    if not found:
        return
    if len(found) > 1:
        raise invalid(found[1][0], f"give one constraint; {found[0][0]} is given too")
    key, kind, value = found[0]
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise invalid(key, "must be a list of strings")
    elif kind == "json_schema":
        if not isinstance(value, str | dict):
            raise invalid(key, "must be a JSON schema (an object, or its text)")
        if flexible and isinstance(value, dict):  # llguidance's own option, in the schema
            value = {**value, "x-guidance": {**value.get("x-guidance", {}),
                                             "whitespace_flexible": True}}
    elif kind == "structural_tag":
        if not isinstance(value, str | dict):
            raise invalid(key, "must be a structural tag (an object, or its text)")
    elif not isinstance(value, str):
        raise invalid(key, "must be a string")
    set_guided(p, kind, value)
    names[f"sampling_params.guided_decoding.{kind}{'.values' if kind == 'choice' else ''}"] = key
    names["sampling_params.grammar"] = key  # the scheduler's word for it


def _response_format(fmt: Any) -> list[tuple[str, str, Any]]:
    """OpenAI's response_format: text (no constraint), json_object (any JSON object),
    json_schema (its "schema") or structural_tag (SGLang's and vLLM's: the object itself)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_schema", {"type": "object"})]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema", "must be a JSON schema object")
        return [("response_format.json_schema.schema", "json_schema", schema)]
    if kind == "structural_tag":
        return [("response_format", "structural_tag", fmt)]
    raise invalid("response_format.type", "must be text, json_object, json_schema or "
                                          f"structural_tag, got {show(kind)}")


def _structured_outputs(value: Any) -> list[tuple[str, str, Any]]:
    """vLLM's structured_outputs: one of json, regex, choice, grammar, json_object or
    structural_tag (and disable_any_whitespace: false lets JSON have any whitespace;
    disable_fallback is taken)."""
    if not isinstance(value, dict):
        raise invalid("structured_outputs", "must be an object")
    found = []
    for key, item in value.items():
        path = f"structured_outputs.{key}"
        if key in ("disable_any_whitespace", "disable_fallback"):  # one backend, no fallback
            if not isinstance(item, bool):
                raise invalid(path, "must be true or false")
            continue
        if item is None or item is False and key == "json_object":
            continue
        if key == "json_object":
            found.append((path, "json_schema", {"type": "object"}))
        elif key in _STRUCTURED:
            found.append((path, _STRUCTURED[key], item))
        else:
            raise invalid(path, "not supported; give json, regex, choice, grammar, "
                                "json_object or structural_tag")
    return found
