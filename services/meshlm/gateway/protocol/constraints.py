"""Constrained decoding: the public request's constraint -> the llguidance grammar the engine
follows (`common.SamplingParams.grammar`). Pure: no I/O.

One constraint per request, from SglangService's SamplingParams: `json_schema` or `regex`
(upstream's deprecated fields 14 and 15) or `guided_decoding` (a JSON schema, a regex, an EBNF
grammar in llama.cpp's GBNF form or Lark, or a choice of strings). The routes' own spellings
(SGLang's native `json_schema`, `regex`, `ebnf`; OpenAI's `response_format`; vLLM's
`structured_outputs` and `guided_*`) are put into `guided_decoding` by their parsers
(`openai_constraint`, native.py). Each is turned into a grammar and checked here, so a schema
or regex that cannot be followed is refused (400, naming the field) before anything else sees
the request. JSON is written compactly (no whitespace between tokens, as `json.dumps` with
separators "," and ":" writes it) unless the schema's own "x-guidance" options say otherwise;
`structural_tag` is not supported (UNIMPLEMENTED).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import grpc
import llguidance

from meshlm.common.errors import MeshError, invalid
from sglang.runtime.v1 import sglang_pb2

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # typing only: the stub's, not the module's

JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}  # compact
MAX_CHOICES = 1024


def unimplemented_tag(field_path: str) -> MeshError:
    return MeshError(grpc.StatusCode.UNIMPLEMENTED,
                     f"{field_path}: structural tags are not supported; use a JSON schema, a "
                     "regex, an EBNF grammar or a choice")


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
                                                   "regex, ebnf or choice")
    if which == "structural_tag":
        raise unimplemented_tag(field_path)
    if which == "json_schema":
        return json_schema_grammar(guided.json_schema, field_path)
    if which == "regex":
        return regex_grammar(guided.regex, field_path)
    if which == "ebnf":
        return _checked(_built(lambda: llguidance.grammar_from("ebnf", guided.ebnf), field_path,
                               "EBNF grammar"), field_path, "EBNF grammar")
    return choice_grammar(list(guided.choice.values), f"{field_path}.values")


def json_schema_grammar(schema: str, field_path: str) -> str:
    return _checked(_built(
        lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS),
        field_path, "JSON schema"), field_path, "JSON schema")


def regex_grammar(regex: str, field_path: str) -> str:
    return _checked(llguidance.LLMatcher.grammar_from_regex(regex), field_path, "regex")


def choice_grammar(values: list[str], field_path: str) -> str:
    if not values:
        raise invalid(field_path, "give at least one string to choose from")
    if len(values) > MAX_CHOICES:
        raise invalid(field_path, f"at most {MAX_CHOICES} strings, got {len(values)}")
    if any(not v for v in values):
        raise invalid(field_path, "the strings to choose from must not be empty")
    lark = "start: " + " | ".join(json.dumps(v) for v in values)
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), field_path, "choice")


def _built(build: Any, field_path: str, what: str) -> str:
    try:
        return str(build())
    except (ValueError, TypeError) as exc:
        raise invalid(field_path, f"not a valid {what}: {exc}") from None


def _checked(grammar: str, field_path: str, what: str) -> str:
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise invalid(field_path, f"not a valid {what}: {_one_line(problem)}")
    return grammar


def _one_line(problem: str) -> str:
    """llguidance's message without its drawing of where the error is: the first line and
    the one that says what is wrong."""
    lines = [line.strip() for line in problem.strip().splitlines()]
    said = [line for line in lines[1:] if line.startswith("error:")]
    return "; ".join(lines[:1] + said)


# ---- the routes' spellings -> guided_decoding -------------------------------------------------


def set_guided(p: sglang_pb2.SamplingParams, kind: str, value: Any) -> None:
    """Put one constraint of `kind` (json_schema, regex, ebnf, choice) into
    p.guided_decoding; a JSON schema may be given as an object or as its text."""
    guided = p.guided_decoding
    if kind == "choice":
        guided.choice.values.extend(value)
    elif kind == "json_schema" and not isinstance(value, str):
        guided.json_schema = json.dumps(value)
    else:
        setattr(guided, kind, value)
