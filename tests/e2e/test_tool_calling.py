"""Function calling end to end, with OpenAI's client: a named tool_choice answers with one
call of that function whose arguments follow its parameters' schema, "required" with one or
more calls of the given tools, streamed (OpenAI's tool-call deltas, reassembled by index) or
whole, n samples each, over HTTP and the gRPC ChatComplete alike. Earlier calls and tool
results in the conversation reach the chat template. The default model has random weights:
only the constraint makes its output a call. "auto" is refused without a tool-call parser;
a gateway with --tool-call-parser hermes reads the model's own <tool_call> blocks (here
forced into that form by a regex, as the random model would never write them; their
arguments streamed as they come), one with --tool-call-parser mistral its [TOOL_CALLS] (with
Mistral's nine-character call ids), and one with --reasoning-parser qwen3 also splits a
<think> block from the answer. Bad tools are refused by the field's name."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from helpers import extra_gateway

from meshlm.launch.process import ServiceProcess
from sglang.runtime.v1 import sglang_pb2

USER = [{"role": "user", "content": "What is the weather in Berlin in 3 days?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather at a place.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "days", "unit"],
                   "properties": {"city": {"enum": ["Berlin", "Vienna", "Paris"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"$ref": "#/$defs/unit"}},
                   "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
NOTHING = {"type": "function", "function": {"name": "ping"}}  # no parameters
TOOLS = [WEATHER, TIME, NOTHING]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days", "unit"}, args
    assert args["city"] in ("Berlin", "Vienna", "Paris") and 1 <= args["days"] <= 7
    assert args["unit"] in ("celsius", "fahrenheit")


def _follows_its_tool(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        _weather(arguments)
    elif name == "get_time":
        assert args in ({"zone": "UTC"}, {"zone": "CET"})
    else:
        assert name == "ping" and isinstance(args, dict)


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client, model):
    reply = client.chat.completions.create(model=model, messages=USER, max_tokens=60,
                                           temperature=0, tools=TOOLS, tool_choice=NAMED)
    message = reply.choices[0].message
    assert message.content is None and reply.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    _weather(call.function.arguments)
    # The same without the tools in the way: plain text, no calls.
    free = client.chat.completions.create(model=model, messages=USER, max_tokens=8,
                                          temperature=0, tools=TOOLS, tool_choice="none")
    assert free.choices[0].message.tool_calls is None
    assert free.choices[0].message.content


def test_required_calls_one_or_more_tools_streamed_or_whole(client, model):
    reply = client.chat.completions.create(model=model, messages=USER, max_tokens=200, n=3,
                                           temperature=1.0, seed=3, tools=TOOLS,
                                           tool_choice="required")
    for choice in reply.choices:
        if choice.finish_reason == "length":  # sampled: many calls may not fit
            continue
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            _follows_its_tool(call.function.name, call.function.arguments)
    assert any(c.finish_reason == "tool_calls" for c in reply.choices)
    # One call at most without parallel calls; streamed as OpenAI's deltas.
    stream = client.chat.completions.create(model=model, messages=USER, max_tokens=80, n=2,
                                            temperature=1.0, seed=4, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            stream=True)
    calls: dict[tuple[int, int], dict[str, str]] = {}
    finishes = {}
    for chunk in stream:
        choice = chunk.choices[0]
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault((choice.index, delta.index), {"name": "", "arguments": ""})
            if delta.id:  # the first delta of a call names it
                assert not call["name"] and delta.type == "function"
                call["name"] = delta.function.name
            call["arguments"] += delta.function.arguments or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert sorted(calls) == [(0, 0), (1, 0)]
    for call in calls.values():
        _follows_its_tool(call["name"], call["arguments"])


def test_a_streamed_named_call_matches_the_whole_one(client, model):
    args = {"model": model, "messages": USER, "max_tokens": 60, "temperature": 0,
            "tools": TOOLS, "tool_choice": NAMED}
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls[0]
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**args, stream=True)]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].function.name == "get_weather" and calls[0].id
    assert all(t.index == 0 and t.id is None for t in calls[1:])
    assert "".join(t.function.arguments or "" for t in calls) == whole.function.arguments


def test_a_call_cut_short_by_max_tokens_says_length(client, model):
    reply = client.chat.completions.create(model=model, messages=USER, max_tokens=3,
                                           temperature=0, tools=TOOLS, tool_choice=NAMED)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    [call] = choice.message.tool_calls  # its arguments so far, as a stream would have them
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")


def test_a_conversation_with_earlier_calls_and_their_results(client, model, mesh):
    conversation = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Berlin", "days": 3, "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}]
    reply = client.chat.completions.create(model=model, messages=conversation, max_tokens=5,
                                           temperature=0, tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.content is not None
    # /v1/tokenize renders the same conversation with the tools too.
    url = f"{mesh.addresses.gateway_http}/v1/tokenize"
    body = {"model": model, "messages": conversation, "tools": TOOLS}
    assert httpx.post(url, json=body, timeout=30).json()["count"] > 0


def test_chat_complete_over_grpc_calls_the_named_function(stub):
    body = {"messages": USER, "max_tokens": 60, "temperature": 0, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    [chunk] = list(stub.ChatComplete(sglang_pb2.OpenAIRequest(json_body=json.dumps(body).encode()),
                                     timeout=60))
    [call] = json.loads(chunk.json_chunk)["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) in ({"zone": "UTC"}, {"zone": "CET"})
    with pytest.raises(grpc.RpcError) as err:
        list(stub.ChatComplete(sglang_pb2.OpenAIRequest(json_body=json.dumps(
            {**body, "tool_choice": "auto"}).encode()), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool_choice" in err.value.details()


@pytest.mark.parametrize(("extra", "field", "words"), [
    ({"tools": TOOLS}, "tool_choice", '"auto"'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "parser"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [], "tool_choice": "none"}, "tools", "non-empty"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name",
     "names two tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
     "tools[0].function.name", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters", "JSON schema"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "tool_choice", "response_format"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
])
def test_tools_that_cannot_be_served_are_refused_by_name(client, model, extra, field, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=USER, max_tokens=5, **extra)
    error = err.value.body
    assert error["param"] == field and words in error["message"], error


@pytest.fixture(scope="module")
def hermes_gateway(mesh) -> Iterator[ServiceProcess]:
    yield from extra_gateway(mesh, "hermes", tool_call_parser="hermes")


# The model's own format, as Hermes and Qwen templates teach it: content, then a call.
HERMES_REGEX = (r'Checking\.<tool_call>\n\{"name": "get_time", "arguments": '
                r'\{"zone": "(UTC|CET)"\}\}\n</tool_call>')


def test_auto_reads_the_models_own_tool_calls_with_a_parser(hermes_gateway, model):
    client = openai.OpenAI(base_url=f"{hermes_gateway.http_address}/v1", api_key="x")
    forced = {"structured_outputs": {"regex": HERMES_REGEX}}
    reply = client.chat.completions.create(model=model, messages=USER, max_tokens=60,
                                           temperature=0, tools=TOOLS, extra_body=forced)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) in ({"zone": "UTC"}, {"zone": "CET"})
    # Streamed: the content, then the call: its name, then its arguments as they come.
    stream = client.chat.completions.create(model=model, messages=USER, max_tokens=60,
                                            temperature=0, tools=TOOLS, tool_choice="auto",
                                            extra_body=forced, stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking." and finish == "tool_calls"
    assert {c.index for c in calls} == {0} and len(calls) > 1
    assert calls[0].function.name == "get_time" and calls[0].id.startswith("call_")
    assert not any(c.function.name or c.id for c in calls[1:])
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments
    # The model may answer in text: then it is content, and no call.
    text = client.chat.completions.create(model=model, messages=USER, max_tokens=6,
                                          temperature=0, tools=TOOLS)
    assert text.choices[0].message.tool_calls is None
    assert text.choices[0].message.content and text.choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def mistral_gateway(mesh) -> Iterator[ServiceProcess]:
    yield from extra_gateway(mesh, "mistral", tool_call_parser="mistral")


def test_mistral_calls_and_their_nine_character_ids(mistral_gateway, model):
    """Mistral's v11 format (`[TOOL_CALLS]name[ARGS]{...}`, forced by a regex) read as calls;
    every call id, a forced call's too, is the nine letters and digits its templates want."""
    client = openai.OpenAI(base_url=f"{mistral_gateway.http_address}/v1", api_key="x")
    regex = r'Sure\.\[TOOL_CALLS\]get_time\[ARGS\]\{"zone": "(UTC|CET)"\}'
    reply = client.chat.completions.create(
        model=model, messages=USER, max_tokens=60, temperature=0, tools=TOOLS,
        extra_body={"structured_outputs": {"regex": regex}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and len(call.id) == 9 and call.id.isalnum()
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    forced = client.chat.completions.create(model=model, messages=USER, max_tokens=80,
                                            tools=TOOLS, tool_choice="required")
    assert all(len(c.id) == 9 and c.id.isalnum() for c in forced.choices[0].message.tool_calls)


@pytest.fixture(scope="module")
def qwen3_coder_gateway(mesh) -> Iterator[ServiceProcess]:
    yield from extra_gateway(mesh, "qwen3-coder", tool_call_parser="qwen3_coder")


def test_qwen3_coders_tagged_parameters(qwen3_coder_gateway, model):
    """Qwen3-Coder's calls (`<function=...>` with `<parameter=...>` values, forced by a regex)
    read as calls, each value typed by the tool's schema; streamed, the same call."""
    client = openai.OpenAI(base_url=f"{qwen3_coder_gateway.http_address}/v1", api_key="x")
    regex = (r"Checking\.\n<tool_call>\n<function=get_time>\n<parameter=zone>\n(UTC|CET)\n"
             r"</parameter>\n</function>\n</tool_call>")
    args = {"model": model, "messages": USER, "max_tokens": 80, "temperature": 0,
            "tools": TOOLS, "extra_body": {"structured_outputs": {"regex": regex}}}
    reply = client.chat.completions.create(**args)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments) in ({"zone": "UTC"}, {"zone": "CET"})
    calls = [c for chunk in client.chat.completions.create(**args, stream=True)
             for c in chunk.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "get_time"
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments


@pytest.fixture(scope="module")
def thinking_gateway(mesh) -> Iterator[ServiceProcess]:
    yield from extra_gateway(mesh, "thinking", reasoning_parser="qwen3", tool_call_parser="hermes")


def test_a_reasoning_parser_splits_the_thinking_from_the_answer(thinking_gateway, model):
    """The model's <think> block (here forced by a regex: the random model never writes one)
    is reasoning_content, the rest content; the tool call after it is read too."""
    client = openai.OpenAI(base_url=f"{thinking_gateway.http_address}/v1", api_key="x")
    regex = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){0,3}\n</think>\n\n(Yes|No)\."
    args = {"model": model, "messages": USER, "max_tokens": 120, "temperature": 0,
            "extra_body": {"structured_outputs": {"regex": regex}}}
    reply = client.chat.completions.create(**args)
    message = reply.choices[0].message.model_dump()
    assert message["content"] in ("Yes.", "No."), message
    assert message["reasoning_content"].strip() and "think>" not in message["reasoning_content"]
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta.model_dump()
        for key in streamed:
            streamed[key] += delta.get(key) or ""
    assert streamed == {key: message[key] for key in streamed}
    # SGLang's separate_reasoning: false keeps the thinking in the content.
    together = client.chat.completions.create(
        **{**args, "extra_body": {**args["extra_body"], "separate_reasoning": False}})
    assert together.choices[0].message.content.startswith("<think>")
    # Thinking, then a call in the model's own format.
    call = (r'<think>\n[a-z]{2,8}\n</think>\n\n<tool_call>\n\{"name": "get_time", '
            r'"arguments": \{"zone": "UTC"\}\}\n</tool_call>')
    reply = client.chat.completions.create(model=model, messages=USER, max_tokens=200,
                                           temperature=0, tools=TOOLS,
                                           extra_body={"structured_outputs": {"regex": call}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_time"
    assert choice.message.model_dump()["reasoning_content"].strip()


def test_a_json_answer_comes_after_the_thinking(thinking_gateway, model):
    """With a reasoning parser, a JSON constraint (response_format here) starts after the
    thinking, which the model may open (qwen3): barred from writing "<" it answers in JSON
    at once; pushed to write it, it is in thought (unconstrained) until max_tokens."""
    client = openai.OpenAI(base_url=f"{thinking_gateway.http_address}/v1", api_key="x")
    ids = httpx.post(f"{thinking_gateway.http_address}/v1/tokenize", timeout=10,
                     json={"model": model, "prompt": "<", "add_special_tokens": False})
    [angle] = ids.json()["tokens"]
    schema = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
              "required": ["zone"], "additionalProperties": False}
    args = {"model": model, "messages": USER, "max_tokens": 30, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "zone", "schema": schema}}}
    direct = client.chat.completions.create(**args, logit_bias={str(angle): -100})
    message = direct.choices[0].message.model_dump()
    assert json.loads(message["content"])["zone"] in ("UTC", "CET"), message
    assert not message["reasoning_content"]
    thought = client.chat.completions.create(**args, logit_bias={str(angle): 100})
    message = thought.choices[0].message.model_dump()
    assert thought.choices[0].finish_reason == "length" and not message["content"], message
    assert message["reasoning_content"], message
