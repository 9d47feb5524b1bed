"""Structural tags (XGrammar's form, current and earlier) -> llguidance grammars: what each
format lets through, checked byte by byte with llguidance's own matcher, and the refusals."""

from __future__ import annotations

import json
from typing import Any

import grpc
import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol.constraints import structural_tag_grammar

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}


def _grammar(doc: Any) -> str:
    grammar = structural_tag_grammar(json.dumps(doc), "f")
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    return grammar


def _follows(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar, log_level=0)
    return bool(matcher.consume_tokens(list(text.encode())) and matcher.is_accepting())


def _fmt(fmt: dict[str, Any]) -> str:
    return _grammar({"type": "structural_tag", "format": fmt})


def _tag(begin: str, content: dict[str, Any], end: Any = "</function>") -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema}


TOOLS = [_tag("<function=get_weather>", _schema(WEATHER)),
         _tag("<function=get_time>", _schema({"type": "object"}))]


@pytest.mark.parametrize(("text", "follows"), [
    ("no call at all", True),
    ('I will call <function=get_weather>{"city":"SF"}</function> then talk', True),
    ('<function=get_time>{}</function><function=get_weather>{"city":"a"}</function>', True),
    ("a <functio b", True),  # not the whole trigger: free text
    ('x <function=foo>{"city":"a"}</function>', False),  # no such tag after the trigger
    ('x <function=get_weather>{"town":"SF"}</function>', False),  # not its schema
    ('x <function=get_weather>{"city": "SF"}</function>', False),  # JSON is compact
    ('x <function=get_weather>{"city":"SF"}', False),  # its end is missing
])
def test_the_earlier_form_is_free_text_with_triggered_structures(text: str,
                                                                 follows: bool) -> None:
    grammar = _grammar({"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": {"type": "object"}, "end": "</function>"}]})
    assert _follows(grammar, text) is follows


def test_triggered_tags_same_as_the_earlier_form_and_several_triggers() -> None:
    grammar = _fmt({"type": "triggered_tags", "triggers": ["<function=", "<tool>"],
                    "tags": [*TOOLS, _tag("<tool>", {"type": "regex", "pattern": "[0-9]+"},
                                          "</tool>")]})
    assert _follows(grammar, 'a <tool>42</tool> b <function=get_time>{}</function> c')
    assert not _follows(grammar, "a <tool>x</tool>")


@pytest.mark.parametrize(("at_least_one", "stop_after_first", "text", "follows"), [
    (True, False, '<function=get_time>{}</function> and text', True),
    (True, False, 'text first <function=get_time>{}</function>', False),
    (True, False, "no call", False),
    (False, True, 'text <function=get_time>{}</function>', True),
    (False, True, 'text <function=get_time>{}</function> more', False),
    (False, True, "no call", True),
    (True, True, '<function=get_time>{}</function>', True),
    (True, True, '<function=get_time>{}</function><function=get_time>{}</function>', False),
    (True, True, "", False),
])
def test_triggered_tags_flags(at_least_one: bool, stop_after_first: bool, text: str,
                              follows: bool) -> None:
    grammar = _fmt({"type": "triggered_tags", "triggers": ["<function="], "tags": TOOLS,
                    "at_least_one": at_least_one, "stop_after_first": stop_after_first})
    assert _follows(grammar, text) is follows


def test_free_text_in_a_tag_ends_at_the_tag_end() -> None:
    grammar = _fmt({"type": "sequence", "elements": [
        _tag("<think>", {"type": "any_text"}, "</think>"),
        {"type": "const_string", "value": "\nAnswer: "},
        _schema(WEATHER)]})
    assert _follows(grammar, '<think>a < b, </thin</think>\nAnswer: {"city":"Oslo"}')
    assert not _follows(grammar, '<think>x</think> and more</think>\nAnswer: {"city":"a"}')
    assert not _follows(grammar, '<think>x</think>\nAnswer: yes')


def test_any_text_excludes_and_bounds() -> None:
    grammar = _fmt({"type": "any_text", "excludes": ["<tool>", "\n\n"]})
    assert _follows(grammar, "one line\nand another")
    assert not _follows(grammar, "a <tool> b") and not _follows(grammar, "a\n\nb")
    short = _fmt(_tag("<t>", {"type": "any_text", "max_chars": 3}, ["</t>", "</u>"]))
    assert _follows(short, "<t>abc</t>") and _follows(short, "<t></u>")
    assert not _follows(short, "<t>abcd</t>")


def test_tags_with_separator() -> None:
    tags = [_tag("<a>", _schema({"type": "integer"}), "</a>")]
    listed = _fmt({"type": "tags_with_separator", "tags": tags, "separator": ","})
    assert _follows(listed, "") and _follows(listed, "<a>1</a>,<a>2</a>")
    assert not _follows(listed, "<a>1</a> <a>2</a>") and not _follows(listed, "hi")
    one = _fmt({"type": "tags_with_separator", "tags": tags, "separator": ",",
                "at_least_one": True, "stop_after_first": True})
    assert _follows(one, "<a>1</a>") and not _follows(one, "") and not _follows(
        one, "<a>1</a>,<a>2</a>")


def test_the_composition_formats() -> None:
    yes_no = {"type": "or", "elements": [{"type": "const_string", "value": "yes"},
                                         {"type": "grammar", "grammar": 'root ::= "no"'}]}
    grammar = _fmt({"type": "sequence", "elements": [
        {"type": "optional", "content": {"type": "const_string", "value": "Q: "}},
        {"type": "repeat", "min": 1, "max": 2, "content": {"type": "regex",
                                                           "pattern": "[A-Z]"}},
        {"type": "star", "content": {"type": "const_string", "value": "!"}},
        {"type": "plus", "content": yes_no}]})
    assert _follows(grammar, "Q: AByesno") and _follows(grammar, "A!!!no")
    assert not _follows(grammar, "yes") and not _follows(grammar, "ABCyes")


@pytest.mark.parametrize(("doc", "field", "words"), [
    ("not json", "f", "not valid JSON"),
    ({"type": "json_schema"}, "f.type", "must be structural_tag"),
    ({"type": "structural_tag"}, "f", "give its format"),
    ({"format": {"type": "token", "token": "<x>"}}, "f.format.type", "not supported"),
    ({"format": {"type": "dispatch", "rules": []}}, "f.format.type", "not supported"),
    ({"format": {"type": "text"}}, "f.format.type", "must be one of"),
    ({"format": {"type": "const_string"}}, "f.format.value", "is required"),
    ({"format": {"type": "const_string", "value": "a", "extra": 1}}, "f.format.extra",
     "not a field"),
    ({"format": {"type": "tag", "begin": {"type": "token", "token": "<x>"},
                 "content": {"type": "any_text"}, "end": ""}}, "f.format.begin", "token-level"),
    ({"format": {"type": "sequence", "elements": []}}, "f.format.elements", "non-empty"),
    ({"format": {"type": "json_schema", "json_schema": {"type": "nope"}}},
     "f.format.json_schema", "not a valid JSON schema"),
    ({"format": {"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}},
     "f.format.style", "only json"),
    ({"format": {"type": "regex", "pattern": "("}}, "f.format.pattern", "not a valid regex"),
    ({"format": {"type": "triggered_tags", "triggers": ["<f="], "tags": TOOLS}},
     "f.format.tags[0].begin", "exactly one of the triggers"),
    ({"format": {"type": "triggered_tags", "triggers": ["<f", "<function="], "tags": TOOLS}},
     "f.format.tags[0].begin", "exactly one of the triggers"),
    ({"format": {"type": "triggered_tags", "triggers": [""], "tags": TOOLS}},
     "f.format.triggers[0]", "must not be empty"),
    ({"format": {"type": "repeat", "min": 3, "max": 2, "content": {"type": "any_text"}}},
     "f.format.max", "must be an integer in [3,"),
    ({"triggers": ["<f"], "structures": [{"begin": "<f>", "end": ""}]},
     "f.structures[0].schema", "is required"),
    ({"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {"type": "x"},
                                          "end": ""}]},
     "f.structures[0].schema", "not a valid JSON schema"),
])
def test_refusals_name_the_field(doc: Any, field: str, words: str) -> None:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(MeshError) as caught:
        structural_tag_grammar(text, "f")
    assert caught.value.message.startswith(f"{field}: "), caught.value.message
    assert words in caught.value.message


def test_a_deep_tag_is_refused() -> None:
    fmt: dict[str, Any] = {"type": "const_string", "value": "x"}
    for _ in range(40):
        fmt = {"type": "optional", "content": fmt}
    with pytest.raises(MeshError, match="too large"):
        structural_tag_grammar(json.dumps({"format": fmt}), "f")


_TEXT = st.text(alphabet=st.sampled_from(list("ab<>/=\\\"{} \n.*")), max_size=6)
_LEAF = st.one_of(
    st.builds(lambda v: {"type": "const_string", "value": v}, _TEXT),
    st.builds(lambda p: {"type": "regex", "pattern": p}, _TEXT),
    st.builds(lambda e: {"type": "any_text", "excludes": e}, st.lists(_TEXT, max_size=2)),
    st.just({"type": "json_schema", "json_schema": {"type": "integer"}}),
    st.just({"type": "token", "token": "<x>"}),
    st.none(), st.integers(), _TEXT,
)


def _composite(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    tag = st.builds(lambda b, c, e: {"type": "tag", "begin": b, "content": c, "end": e},
                    _TEXT, inner, st.one_of(_TEXT, st.lists(_TEXT, max_size=2)))
    return st.one_of(
        st.builds(lambda e: {"type": "sequence", "elements": e}, st.lists(inner, max_size=3)),
        st.builds(lambda e: {"type": "or", "elements": e}, st.lists(inner, max_size=3)),
        st.builds(lambda c: {"type": "star", "content": c}, inner),
        st.builds(lambda lo, hi, c: {"type": "repeat", "min": lo, "max": hi, "content": c},
                  st.integers(-1, 3), st.integers(-2, 3), inner),
        tag,
        st.builds(lambda t, ts, a, s: {"type": "triggered_tags", "triggers": t, "tags": ts,
                                       "at_least_one": a, "stop_after_first": s},
                  st.lists(_TEXT, max_size=2), st.lists(tag, max_size=2), st.booleans(),
                  st.booleans()),
        st.builds(lambda ts, sep: {"type": "tags_with_separator", "tags": ts,
                                   "separator": sep}, st.lists(tag, max_size=2), _TEXT),
    )


@settings(max_examples=300, deadline=None)
@given(st.recursive(_LEAF, _composite, max_leaves=8))
def test_any_tag_is_a_grammar_or_a_refusal_by_name(fmt: Any) -> None:
    """Whatever the tag, the answer is a grammar llguidance takes or an INVALID_ARGUMENT."""
    try:
        grammar = structural_tag_grammar(json.dumps({"format": fmt}), "f")
    except MeshError as e:
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and e.message.startswith("f"), e
        return
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
