"""Function calling's pure parts: tools and tool_choice read from a chat body (the schema a
forced call is constrained to, refusals by field), earlier calls' arguments handed to the
template as objects, and the scanner that turns the constrained output into OpenAI's
tool-call deltas and whole calls, however the text is split."""

from __future__ import annotations

import json
import random
from typing import Any

import llguidance
import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from meshlm.common.errors import MeshError
from meshlm.gateway.mesh.inbox import Update
from meshlm.gateway.protocol.chat_output import ChatOutput, call_reader
from meshlm.gateway.protocol.deepseek_calls import (
    DeepSeekV3Calls,
    DeepSeekV31Calls,
    KimiK2Calls,
)
from meshlm.gateway.protocol.forced_calls import ForcedCalls
from meshlm.gateway.protocol.json_body import JsonBody
from meshlm.gateway.protocol.openai import parse_chat, template_request
from meshlm.gateway.protocol.openai_responses import ChatAnswer
from meshlm.gateway.protocol.tool_calls import parse_tools
from meshlm.gateway.protocol.tool_parsers import (
    PARSERS,
    HermesCalls,
    JsonCalls,
    MistralCalls,
    PythonicCalls,
)
from meshlm.gateway.protocol.xml_calls import Glm45Calls, Qwen3CoderCalls
from meshlm.v1 import gateway_pb2

USER = [{"role": "user", "content": "hi"}]
UNIT = {"type": "function", "function": {"name": "unit", "parameters": {
    "type": "object", "properties": {"u": {"$ref": "#/$defs/u"}, "again": {"$ref": "#"}},
    "required": ["u"], "additionalProperties": False, "$defs": {"u": {"enum": ["c", "f"]}}}}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {
    "type": "object", "properties": {"u": {"$ref": "#/definitions/u"}}, "required": ["u"],
    "additionalProperties": False, "definitions": {"u": {"enum": ["x"]}}}}}
BARE = {"type": "function", "function": {"name": "bare"}}


def _choice(doc: dict[str, Any]) -> Any:
    return parse_tools(JsonBody(orjson.dumps(doc)))


def _follows(schema: dict[str, Any], text: str) -> bool:
    """Whether llguidance's grammar of `schema` (as the gateway builds it) takes `text`."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False})
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return (matcher.consume_tokens(tokenizer.tokenize_str(text)) and not matcher.is_error()
            and matcher.is_accepting())


def test_required_is_an_array_of_calls_each_following_its_tool() -> None:
    tools, choice = _choice({"tools": [UNIT, OTHER, BARE], "tool_choice": "required"})
    assert tools == [UNIT, OTHER, BARE] and choice.named is None
    assert choice.schema_field == "tools"
    good = ('[{"name":"unit","parameters":{"u":"c","again":{"u":"f"}}},'
            '{"name":"other","parameters":{"u":"x"}},{"name":"bare","parameters":{}}]')
    assert _follows(choice.schema, good)
    for bad in ('[]', '[{"name":"other","parameters":{"u":"c"}}]',
                '[{"name":"bare","parameters":{"x":1}}]', '[{"name":"nope","parameters":{}}]'):
        assert not _follows(choice.schema, bad), bad
    _, one = _choice({"tools": [UNIT, BARE], "tool_choice": "required",
                      "parallel_tool_calls": False})
    assert not _follows(one.schema, '[{"name":"bare","parameters":{}},'
                                    '{"name":"bare","parameters":{}}]')
    assert _follows(one.schema, '[{"name":"bare","parameters":{}}]')


def test_a_named_function_constrains_to_its_parameters() -> None:
    _, choice = _choice({"tools": [UNIT, OTHER], "tool_choice": {
        "type": "function", "function": {"name": "other"}}})
    assert choice.named == "other" and choice.schema_field == "tools[1].function.parameters"
    assert _follows(choice.schema, '{"u":"x"}') and not _follows(choice.schema, '{"u":"c"}')
    _, bare = _choice({"tools": [BARE], "tool_choice": {"function": {"name": "bare"}}})
    assert _follows(bare.schema, "{}") and not _follows(bare.schema, '{"a":1}')


def test_none_and_no_tools_force_nothing_and_auto_is_the_default() -> None:
    assert _choice({"tools": [UNIT], "tool_choice": "none"}) == ([UNIT], None)
    assert _choice({}) == (None, None)
    assert _choice({"tool_choice": "auto"}) == (None, None)
    for doc in ({"tools": [UNIT]}, {"tools": [UNIT], "tool_choice": "auto"}):
        _, auto = _choice(doc)
        assert auto.auto and auto.schema is None and auto.named is None
    req = parse_chat(orjson.dumps({"messages": USER, "tools": [UNIT], "echo": True,
                                   "response_format": {"type": "json_object"}}))
    assert req.tool_choice.auto and req.sampling.HasField("guided_decoding")


def test_a_forced_call_becomes_the_chat_constraint() -> None:
    req = parse_chat(orjson.dumps({"messages": USER, "tools": [UNIT],
                                   "tool_choice": "required"}))
    assert json.loads(req.sampling.guided_decoding.json_schema) == req.tool_choice.schema
    assert req.names["sampling_params.guided_decoding.json_schema"] == "tools"
    chat = template_request(req.messages, True, tools=req.tools)
    assert json.loads(chat.tools_json) == [UNIT]


@pytest.mark.parametrize(("doc", "start"), [
    ({"tools": {"a": 1}, "tool_choice": "none"}, "tools: must be a non-empty list"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type: only function tools"),
    ({"tools": [{"function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters: must be a JSON schema object"),
    ({"tools": [{"function": {"name": "f", "description": 5}}]},
     "tools[0].function.description: must be a string"),
    ({"tools": [{"function": {"name": "x" * 65}}]}, "tools[0].function.name: must be 1 to 64"),
    ({"tools": [UNIT], "tool_choice": "sometimes"}, "tool_choice: give \"none\""),
    ({"tools": [UNIT], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name: must name one of the tools"),
    ({"tools": [UNIT], "tool_choice": "required", "parallel_tool_calls": "no"},
     "parallel_tool_calls: must be true or false"),
    ({"function_call": "auto"}, "function_call: is not supported"),
])
def test_tool_refusals_name_the_field(doc: dict[str, Any], start: str) -> None:
    with pytest.raises(MeshError) as err:
        _choice(doc)
    assert err.value.message.startswith(start), err.value.message


def test_earlier_calls_reach_the_template_with_object_arguments() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "unit", "arguments": '{"u": "c"}'}}
    broken = {"id": "c2", "type": "function", "function": {"name": "unit", "arguments": "{"}}
    messages = [*USER, {"role": "assistant", "content": "", "tool_calls": [call, broken]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    sent = json.loads(template_request(messages, True).messages_json)
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"u": "c"}
    assert sent[1]["tool_calls"][1] == broken  # not JSON: left as the client wrote it
    assert sent[2] == messages[2] and messages[1]["tool_calls"][0] == call  # not changed


_CALL = {"id": "c1", "type": "function", "function": {"name": "unit", "arguments": "{}"}}


@pytest.mark.parametrize(("message", "start"), [
    ({"role": "assistant", "tool_calls": "unit"}, "messages[1].tool_calls: must be a list"),
    ({"role": "assistant", "tool_calls": [{"type": "retrieval"}]},
     "messages[1].tool_calls[0]: must be a function call"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
     "messages[1].tool_calls[0].function: must be an object with a name"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "unit", "arguments": 5}}]},
     "messages[1].tool_calls[0].function.arguments: must be the arguments' JSON text"),
    ({"role": "assistant", "tool_calls": [{**_CALL, "id": 7}]},
     "messages[1].tool_calls[0].id: must be a string"),
    ({"role": "tool", "tool_call_id": ["c1"], "content": "ok"},
     "messages[1].tool_call_id: must be a string"),
])
def test_earlier_calls_in_messages_are_checked(message: dict[str, Any], start: str) -> None:
    body = orjson.dumps({"model": "m", "messages": [*USER, message]})
    with pytest.raises(MeshError) as err:
        parse_chat(body)
    assert err.value.message.startswith(start), err.value.message


def test_earlier_calls_in_their_usual_forms_are_taken() -> None:
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                {"role": "assistant", "tool_calls": [{"function": {"name": "unit",
                                                                    "arguments": {"u": 1}}}]},
                {"role": "tool", "tool_call_id": "c1", "name": "unit", "content": "ok"}]
    assert len(parse_chat(orjson.dumps({"model": "m", "messages": messages})).messages) == 4


def _scanned(text: str, named: str | None, sizes: random.Random | int) -> tuple[Any, Any]:
    """The calls rebuilt from the deltas of `text` fed in pieces, and the scanner's own."""
    scanner = ForcedCalls(named)
    deltas, i = [], 0
    while i < len(text):
        size = sizes if isinstance(sizes, int) else sizes.randint(1, 5)
        content, calls = scanner.feed(text[i:i + size])
        assert content == ""
        deltas += calls
        i += size
    whole = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in scanner.calls()]
    return _rebuilt(deltas), whole


@pytest.mark.parametrize(("text", "calls"), [
    ('[{"name":"a","parameters":{"q":[1,{"b":"}]\\""}]}},{"name":"b\\u0041","parameters":{}}]',
     [("a", '{"q":[1,{"b":"}]\\""}]}'), ("bA", "{}")]),
    (' [ { "parameters" : {"x": 1}, "name" : "late" } ]', [("late", '{"x": 1}')]),
    ('[{"name":"a","parameters":{"q":"cut sho', [("a", '{"q":"cut sho')]),
    ('[{"name":"a","para', [("a", "")]),
    ('[{"na', []),
])
def test_the_scanner_reads_required_output_however_it_is_split(text: str, calls: Any) -> None:
    expected = [{"name": n, "arguments": a} for n, a in calls]
    for sizes in (1, 2, 3, len(text), random.Random(7)):
        rebuilt, whole = _scanned(text, None, sizes)
        assert rebuilt == whole == expected, sizes


def test_the_scanner_reads_a_named_call() -> None:
    rebuilt, whole = _scanned('{"u":"c"}', "unit", 2)
    assert rebuilt == whole == [{"name": "unit", "arguments": '{"u":"c"}'}]
    assert ForcedCalls("unit").feed("") == ("", [])


HERMES = ('Let me look <that> up.<tool_call>\n{"name": "unit", "arguments": {"u": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "other", "arguments": {"u": "x", "é": 1}}\n'
          "</tool_call>")


def _rebuilt(deltas: list[Any]) -> list[dict[str, str]]:
    """The calls that a stream's tool-call deltas add up to (the first of each its id)."""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
        if "id" in delta:
            assert not call["name"] and delta["type"] == "function"
            call["name"] = delta["function"]["name"]
        call["arguments"] += delta["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 2, 5, 11, len(HERMES)])
def test_hermes_blocks_are_read_as_they_stream(size: int) -> None:
    reader = HermesCalls()
    content, deltas, named_at = "", [], None
    pieces = [HERMES[i:i + size] for i in range(0, len(HERMES), size)]
    for i, piece in enumerate(pieces):
        text, calls = reader.feed(piece, last=i == len(pieces) - 1)
        assert "<tool" not in text  # a tag's start is held until it is clear
        content += text
        deltas += calls
        if named_at is None and calls:
            named_at = i
    assert content == reader.content() == "Let me look <that> up.\n"
    whole = [c["function"] for c in reader.calls()]
    assert _rebuilt(deltas) == whole == [
        {"name": "unit", "arguments": '{"u": "c"}'},
        {"name": "other", "arguments": '{"u": "x", "é": 1}'}]
    if size < len(HERMES):  # the first call's name comes before its block ends
        assert named_at is not None and "</tool_call>" not in "".join(pieces[:named_at + 1])
    if size == 1:
        assert len(deltas) > 4  # the arguments came in pieces


def test_hermes_text_without_calls_and_broken_blocks_stay_content() -> None:
    plain = HermesCalls()
    assert plain.feed("a <tool", last=False) == ("a ", [])
    assert plain.feed("box> b <tool_c", last=True) == ("<toolbox> b <tool_c", [])
    assert plain.calls() == []
    broken = HermesCalls()
    assert broken.feed("<tool_call>{not json}</tool_call>ok") == (
        "<tool_call>{not json}</tool_call>ok", [])
    as_text = HermesCalls()  # arguments written as their JSON's text
    _, deltas = as_text.feed('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}'
                             '</tool_call>', last=True)
    assert _rebuilt(deltas) == [{"name": "f", "arguments": '{"a": 1}'}]
    late = HermesCalls()  # the name after the arguments: they wait for it
    _, deltas = late.feed('<tool_call>{"arguments": {"a": [1, "}"]} , "name": "f"}',
                          last=False)
    assert _rebuilt(deltas) == [{"name": "f", "arguments": '{"a": [1, "}"]}'}]
    no_args = HermesCalls()
    _, deltas = no_args.feed('<tool_call>{"name": "f"}</tool_call>', last=True)
    assert _rebuilt(deltas) == [{"name": "f", "arguments": "{}"}]
    cut = HermesCalls()  # unclosed at the end: the call so far
    _, deltas = cut.feed('<tool_call>{"name": "f", "arguments": {"a": 1', last=True)
    assert _rebuilt(deltas) == [{"name": "f", "arguments": '{"a": 1'}]
    unnamed = HermesCalls()
    assert unnamed.feed('x<tool_call>{"na', last=True) == ('x<tool_call>{"na', [])
    nameless = HermesCalls()  # a block that names no call is content
    assert nameless.feed('<tool_call>{"arguments": {}}</tool_call>', last=True) == (
        '<tool_call>{"arguments": {}}</tool_call>', [])


def _update(text: str, done: str | None = None) -> Update:
    final = gateway_pb2.TextOutput(finished=True, finish_reason=done) if done else None
    return Update(text=text, token_ids=[1], final=final, error=None, prompt_tokens=3,
                  completion_tokens=1, cached_tokens=0)


def test_a_chat_answer_with_a_forced_call() -> None:
    _, choice = _choice({"tools": [UNIT], "tool_choice": "required"})
    options = {"model": "m", "created": 1, "n": 1, "prompts": 1, "include_usage": False,
               "top_logprobs": None,
               "output": lambda: ChatOutput(None, ForcedCalls(choice.named))}
    whole = ChatAnswer(stream=False, **options)
    whole.add(0, _update('[{"name":"unit","parameters":{"u":"f"}}]', "stop"), {"id": "r"})
    [reply] = whole.response()["choices"]
    assert reply["finish_reason"] == "tool_calls"
    message = reply["message"]
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "unit", "arguments": '{"u":"f"}'}
    stream = ChatAnswer(stream=True, **options)
    chunks = []
    for piece in ('[{"na', 'me":"unit","pa', 'rameters":{"u":', '"c"}}]'):
        chunks += stream.add(0, _update(piece), {"id": "r"})
    chunks += stream.add(0, _update("", "length"), {"id": "r"})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"  # then no chunk until the name is known
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "unit", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"]
                   for d in deltas[2:-1]) == '{"u":"c"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in deltas[-1]


def test_a_chat_answer_read_by_a_parser() -> None:
    options = {"model": "m", "created": 1, "n": 1, "prompts": 1, "include_usage": False,
               "top_logprobs": None, "output": lambda: ChatOutput(None, HermesCalls())}
    whole = ChatAnswer(stream=False, **options)
    whole.add(0, _update(HERMES, "stop"), {"id": "r"})
    [reply] = whole.response()["choices"]
    assert reply["finish_reason"] == "tool_calls"
    assert reply["message"]["content"] == "Let me look <that> up.\n"
    assert len(reply["message"]["tool_calls"]) == 2
    plain = ChatAnswer(stream=False, **options)
    plain.add(0, _update("just text", "stop"), {"id": "r"})
    [reply] = plain.response()["choices"]
    assert reply["finish_reason"] == "stop" and reply["message"]["content"] == "just text"
    assert "tool_calls" not in reply["message"]
    stream = ChatAnswer(stream=True, **options)
    chunks = stream.add(0, _update("Hi <tool_"), {"id": "r"})
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "Hi "]
    chunks = stream.add(0, _update('call>{"name": "f", "arguments": {}}</tool_call>', "stop"),
                        {"id": "r"})
    [last] = chunks
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    assert last["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "f"


def _read(reader: Any, text: str, size: int) -> tuple[str, list[tuple[int, str, str]]]:
    """The content and calls (index, name, arguments) of `text` fed in pieces of `size`,
    checked against the reader's whole reply."""
    content, deltas = "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        more, calls = reader.feed(piece, last=i == len(pieces) - 1)
        content += more
        deltas += calls
    assert content == reader.content()
    calls = _rebuilt(deltas)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reader.calls()] == \
        [(c["name"], c["arguments"]) for c in calls]
    return content, [(i, c["name"], c["arguments"]) for i, c in enumerate(calls)]


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize(("text", "content", "calls"), [
    ('<|python_tag|>{"name": "a", "parameters": {"x": "}{"}}; {"name": "b", "parameters": {}}',
     "", [(0, "a", '{"x": "}{"}'), (1, "b", "{}")]),
    (' {"name": "a", "arguments": {"x": 1}}', "", [(0, "a", '{"x": 1}')]),
    ('Hello {"name": "a", "parameters": {}}', 'Hello {"name": "a", "parameters": {}}', []),
    ("<|python", "<|python", []),
    ('{"name": "a", "parameters": {"x": ', "", [(0, "a", '{"x":')]),  # cut: the call so far
    ('{"name": "a", "parameters": {}}; and so on', "and so on", [(0, "a", "{}")]),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "Bob"}', '{"name": "Bob"}', []),  # no arguments: an answer in JSON, not a call
    ('{"name": "a", "parameters": "{\\"x\\": 1}"}', "", [(0, "a", '{"x": 1}')]),
])
def test_llama_json_calls(size: int, text: str, content: str, calls: Any) -> None:
    assert _read(JsonCalls(), text, size) == (content, calls)


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize(("text", "content", "calls"), [
    ('[get_weather(city="Paris", days=3), ping()]', "",
     [(0, "get_weather", '{"city": "Paris", "days": 3}'), (1, "ping", "{}")]),
    ("[f(x=[1, {'a': None}], y=True)]", "", [(0, "f", '{"x": [1, {"a": null}], "y": true}')]),
    ("Paris is sunny.", "Paris is sunny.", []),
    ("[f(1)]", "[f(1)]", []),  # positional arguments: not a call here
    ("[f(x=open('/etc'))]", "[f(x=open('/etc'))]", []),  # only literals
    ("[f(x=", "[f(x=", []),
    ("[os.system(x='y')]", "[os.system(x='y')]", []),
    ("[f(s=')]('), g(1)]", "g(1)]", [(0, "f", '{"s": ")]("}')]),  # a call, then not one
    ('[f(s="a\\"b")] Done.', " Done.", [(0, "f", '{"s": "a\\"b"}')]),
    ("[f(), g(x=", "g(x=", [(0, "f", "{}")]),  # cut in its second call
])
def test_pythonic_calls(size: int, text: str, content: str, calls: Any) -> None:
    assert _read(PythonicCalls(), text, size) == (content, calls)


def test_llama_json_calls_stream_their_arguments() -> None:
    reader = JsonCalls()
    assert reader.feed('{"name": "a", ') == ("", [])  # not a call until its arguments begin
    _, deltas = reader.feed('"parameters": {"x"')
    assert [d["function"] for d in deltas] == [{"name": "a", "arguments": '{"x"'}]
    _, deltas = reader.feed(': 1}}', last=True)
    assert deltas == [{"index": 0, "function": {"arguments": ": 1}"}}]


MISTRAL_V11 = ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
               '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"zone": "UTC"}')


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize(("text", "content", "calls"), [
    ('[TOOL_CALLS] [{"name": "a", "arguments": {"x": [1, "]"]}}, {"name": "b", "arguments": {}}]',
     "", [(0, "a", '{"x": [1, "]"]}'), (1, "b", "{}")]),
    ('Let me check. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]', "Let me check. ",
     [(0, "a", '{"x": 1}')]),
    (MISTRAL_V11, "Sure.", [(0, "get_weather", '{"city": "Paris"}'),
                            (1, "get_time", '{"zone": "UTC"}')]),
    ("[TOOL_CALLS]f[ARGS]{}", "", [(0, "f", "{}")]),
    ("Just text, [TOOL_CALL] not a tag", "Just text, [TOOL_CALL] not a tag", []),
    ("[TOOL_CALLS]f", "[TOOL_CALLS]f", []),  # no arguments by the end: content
    ('[TOOL_CALLS]f[ARGS]{"x": "cut', "", [(0, "f", '{"x": "cut')]),
])
def test_mistral_calls(size: int, text: str, content: str, calls: Any) -> None:
    assert _read(MistralCalls(), text, size) == (content, calls)


def test_mistral_call_ids_are_nine_letters_and_digits_or_the_models() -> None:
    reader = MistralCalls()
    reader.feed(MISTRAL_V11, last=True)
    first, second = (c["id"] for c in reader.calls())
    assert len(first) == 9 and first.isalnum() and second == "a1B2c3D4e"


def test_a_forced_calls_ids_follow_the_gateways_parser() -> None:
    body = orjson.dumps({"model": "m", "messages": USER, "tools": [UNIT],
                         "tool_choice": "required"})
    for parser, mistral in (("mistral", True), ("hermes", False), ("", False)):
        reader = call_reader(parse_chat(body), parser)
        assert reader is not None
        calls = reader()
        calls.feed('[{"name": "unit", "parameters": {"u": "c"}}]', last=True)
        [call] = calls.calls()
        assert (len(call["id"]) == 9 and call["id"].isalnum()) is mistral, call["id"]
    kimi = call_reader(parse_chat(body), "kimi_k2")
    assert kimi is not None
    calls = kimi()
    calls.feed('[{"name": "unit", "parameters": {"u": "c"}}, {"name": "unit", "parameters": '
               '{"u": "f"}}]', last=True)
    assert [c["id"] for c in calls.calls()] == ["functions.unit:0", "functions.unit:1"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "where": {"type": "object"}, "hours": {"type": ["array", "null"]},
        "note": {"anyOf": [{"type": "null"}, {"type": "string"}]}}}}}
QWEN3_CODER = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n007 Paris"
               "\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n"
               "</parameter>\n<parameter=where>\n{'lat': 1.5}\n</parameter>\n<parameter=hours>"
               "\n[1, 2]\n</parameter>\n<parameter=note>\n42\n</parameter>\n<parameter=extra>\n"
               "{\"a\": null}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
               "<function=get_time>\n</function>\n</tool_call>")
QWEN3_ARGS = ('{"city": "007 Paris", "days": 3, "metric": true, "where": {"lat": 1.5}, '
              '"hours": [1, 2], "note": "42", "extra": {"a": null}}')


@pytest.mark.parametrize("size", [1, 3, 17, len(QWEN3_CODER)])
@pytest.mark.parametrize(("text", "content", "calls"), [
    (QWEN3_CODER, "I will check.\n\n", [(0, "get_weather", QWEN3_ARGS), (1, "get_time", "{}")]),
    # The last parameter's closing tag missing (the model's slip), or the output cut in it.
    ("<tool_call>\n<function=f>\n<parameter=days>\n5\n</function>\n</tool_call>", "",
     [(0, "f", '{"days": 5}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs", "",
     [(0, "get_weather", '{"city": "Os"}')]),
    ("Text with <tool_call> but no function</tool_call> after",
     "Text with <tool_call> but no function</tool_call> after", []),
])
def test_qwen3_coder_calls(size: int, text: str, content: str, calls: Any) -> None:
    """Each value by its parameter's type in the tools: a string stays text (even "007
    Paris"), the others are read as JSON or a Python literal; one the tools do not describe
    as JSON where it reads so."""
    assert _read(Qwen3CoderCalls(tools=[WEATHER]), text, size) == (content, calls)


GLM45 = ("Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>"
         "\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")


@pytest.mark.parametrize("size", [1, 4, len(GLM45)])
@pytest.mark.parametrize(("text", "content", "calls"), [
    (GLM45, "Checking.", [(0, "get_weather", '{"city": "Oslo", "days": 2}')]),
    # GLM-4.7: no newline after the name; a call without arguments.
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>"
     "<tool_call>get_time</tool_call>", "",
     [(0, "get_weather", '{"city": "Rome"}'), (1, "get_time", "{}")]),
])
def test_glm45_calls(size: int, text: str, content: str, calls: Any) -> None:
    assert _read(Glm45Calls(tools=[WEATHER]), text, size) == (content, calls)


def test_xml_parsers_get_the_requests_tools() -> None:
    body = orjson.dumps({"model": "m", "messages": USER, "tools": [WEATHER]})
    reader = call_reader(parse_chat(body), "qwen3_coder")
    assert reader is not None
    calls = reader()
    calls.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n"
               "</function>\n</tool_call>", last=True)
    assert json.loads(calls.calls()[0]["function"]["arguments"]) == {"city": "12"}


B, C, S, E, F = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                 "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_V3 = (f"Let me check.{B}{C}function{S}get_weather\n```json\n{{\"city\": \"Oslo\"}}\n```"
               f"{E}\n{C}function{S}get_time\n```json\n{{}}\n```{E}{F}")
DEEPSEEK_V31 = f'Sure.{B}{C}get_weather{S}{{"city": "Oslo"}}{E}{C}get_time{S}{{}}{E}{F}'


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize(("reader", "text", "content", "calls"), [
    (DeepSeekV3Calls, DEEPSEEK_V3, "Let me check.",
     [(0, "get_weather", '{"city": "Oslo"}'), (1, "get_time", "{}")]),
    (DeepSeekV31Calls, DEEPSEEK_V31, "Sure.",
     [(0, "get_weather", '{"city": "Oslo"}'), (1, "get_time", "{}")]),
    (DeepSeekV31Calls, f'{B}{C}get_weather{S}{{"city": "Os', "",
     [(0, "get_weather", '{"city": "Os')]),  # cut by max_tokens: the arguments so far
    (DeepSeekV3Calls, f"{B}{C}function{S}f\n```json\n{{\"a\": 1", "", [(0, "f", '{"a": 1')]),
    (DeepSeekV31Calls, f"Plain {B}nothing{F} text", f"Plain {B}nothing{F} text", []),
])
def test_deepseek_calls(reader: Any, size: int, text: str, content: str, calls: Any) -> None:
    assert _read(reader(), text, size) == (content, calls)


KIMI = ("Let me see.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>'
        "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>")


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_kimi_k2_calls_keep_their_heads_as_ids(size: int) -> None:
    reader = KimiK2Calls()
    assert _read(reader, KIMI, size) == ("Let me see.", [
        (0, "get_weather", '{"city": "Oslo"}'), (1, "get_time", "{}")])
    assert [c["id"] for c in reader.calls()] == ["functions.get_weather:0",
                                                 "functions.get_time:1"]


def test_pythonic_calls_come_as_each_closes() -> None:
    reader = PythonicCalls()
    assert reader.feed("[get_time(zone='U") == ("", [])
    _, deltas = reader.feed("TC'), ping(")
    assert [d["function"]["name"] for d in deltas] == ["get_time"]
    _, deltas = reader.feed(")]", last=True)
    assert [d["function"]["name"] for d in deltas] == ["ping"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("[](){},=' \"\\fgx1_")), max_size=40),
       st.integers(1, 8))
def test_pythonic_reading_never_fails_and_loses_nothing(text: str, size: int) -> None:
    """Whatever the output, however it is split: no error, the same reply as read whole, and
    every character either content or inside a call read."""
    content, calls = _read(PythonicCalls(), "[" + text, size)
    assert ("[" + text).endswith(content)  # what follows the calls read
    if not calls:
        assert content == "[" + text


_PIECES = ["<tool_call>", "</tool_call>", "<function=f>", "<parameter=x>", "</parameter>",
           "</function>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", B, C, S, E,
           F, "<|tool_calls_section_begin|>", "<|tool_call_begin|>functions.f:0",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "[TOOL_CALLS]", "[ARGS]",
           '{"name": "f", "arguments": {"a": 1}}', "\n", "1", "x", " ", "```json", "```",
           "function", "<", "{", "}", "[", "]"]


@settings(max_examples=200, deadline=None)
@example(["\n", "<tool_call>"], 1, "pythonic")  # white space held, then content: all of it
@given(st.lists(st.sampled_from(_PIECES), max_size=12), st.integers(1, 9),
       st.sampled_from(sorted(PARSERS)))
def test_every_parser_reads_any_output_the_same_however_split(pieces: list[str], size: int,
                                                              parser: str) -> None:
    """No error on any output; streamed in pieces, the same content and calls as whole."""
    reader = PARSERS[parser]
    text = "".join(pieces)
    whole = _read(reader(tools=[WEATHER]) if reader.NEEDS_TOOLS else reader(), text, len(text)
                  or 1)
    split = _read(reader(tools=[WEATHER]) if reader.NEEDS_TOOLS else reader(), text, size)
    assert split == whole
