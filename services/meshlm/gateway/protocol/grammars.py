"""The grammar builders: a JSON schema, a regex, an EBNF or Lark grammar, or a choice of
strings -> an llguidance grammar, checked; each refusal names the field (INVALID_ARGUMENT).
Pure: no I/O. JSON is written compactly (no whitespace between tokens, as `json.dumps` with
separators "," and ":" writes it) unless the schema's own "x-guidance" options say otherwise.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

import llguidance

from meshlm.common.errors import invalid

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # typing only: the stub's, not the module's

JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}  # compact
MAX_CHOICES = 1024
GRAMMARS_KEPT = 32


# Each builder keeps its last grammars (by the constraint's text and field): clients tend to
# send the same schema with every request, and a completions request with several prompts
# checks it once per prompt. Refusals are not kept.


@functools.lru_cache(maxsize=GRAMMARS_KEPT)
def json_schema_grammar(schema: str, field_path: str) -> str:
    return checked(_built(
        lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS),
        field_path, "JSON schema"), field_path, "JSON schema")


@functools.lru_cache(maxsize=GRAMMARS_KEPT)
def regex_grammar(regex: str, field_path: str) -> str:
    return checked(llguidance.LLMatcher.grammar_from_regex(regex), field_path, "regex")


@functools.lru_cache(maxsize=GRAMMARS_KEPT)
def ebnf_grammar(ebnf: str, field_path: str) -> str:
    return checked(_built(lambda: llguidance.grammar_from("ebnf", ebnf), field_path,
                           "EBNF grammar"), field_path, "EBNF grammar")


@functools.lru_cache(maxsize=GRAMMARS_KEPT)
def choice_grammar(values: tuple[str, ...], field_path: str) -> str:
    if not values:
        raise invalid(field_path, "give at least one string to choose from")
    if len(values) > MAX_CHOICES:
        raise invalid(field_path, f"at most {MAX_CHOICES} strings, got {len(values)}")
    if any(not v for v in values):
        raise invalid(field_path, "the strings to choose from must not be empty")
    lark = "start: " + " | ".join(json.dumps(v) for v in values)
    return checked(llguidance.LLMatcher.grammar_from_lark(lark), field_path, "choice")


def _built(build: Any, field_path: str, what: str) -> str:
    try:
        return str(build())
    except (ValueError, TypeError) as exc:
        raise invalid(field_path, f"not a valid {what}: {exc}") from None


def checked(grammar: str, field_path: str, what: str) -> str:
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
